"""parallel.optim in one process: the default optimizer is unsharded (one data-parallel
rank has nothing to shard) and torch's fused AdamW kernel, and its first step is Adam's."""

from __future__ import annotations

import pytest

from conftest import run_check_script
from moe_rl.models.tiny import save_tiny_checkpoint


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    hf_dir = save_tiny_checkpoint(tmp_path_factory.mktemp("optim") / "hf", "qwen3_moe", seed=3)
    return run_check_script("optim_checks.py", hf_dir)


def test_one_data_parallel_rank_does_not_shard_unless_asked(result) -> None:
    assert result["auto_sharded"] is False and result["explicit_sharded"] is True


def test_adam_runs_torchs_fused_kernel_unless_told_otherwise(result) -> None:
    """(No Transformer Engine or apex here: megatron falls back to torch's AdamW.)"""
    assert result["auto_kernels"] == ["fused=True foreach=False"]
    assert result["foreach_kernels"] == ["fused=False foreach=True"]


def test_grad_norm_and_clipping_run_torchs_foreach_kernels_as_megatrons_fallback_would(result) -> None:
    """Without TE or apex (here) megatron's fallbacks are swapped for foreach ones in a real
    run; on random gradients they give megatron's fallback results bit for bit."""
    import torch
    from megatron.core.utils import local_multi_tensor_scale

    from parallel.megatron_compat import foreach_l2_norm, foreach_scale

    assert result["grad_norm_and_clip_kernels"] == [True, True]
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        grads = [
            torch.randn(int(torch.randint(1, 3000, (), generator=gen)), generator=gen) * 10.0 ** (trial % 7 - 5)
            for _ in range(int(torch.randint(1, 25, (), generator=gen)))
        ]
        # megatron's local_multi_tensor_l2_norm (less its device="cuda"): each norm, then theirs
        expected = torch.norm(torch.tensor([[torch.norm(g) for g in grads]]))
        norm, _ = foreach_l2_norm(2048 * 32, None, [grads], False)
        assert norm.shape == (1,) and norm.dtype == torch.float32 and torch.equal(norm[0], expected)
        scale = 1.0 / (1.5 + trial)
        theirs, ours, into = (
            [g.clone() for g in grads],
            [g.clone() for g in grads],
            [torch.empty_like(g) for g in grads],
        )
        local_multi_tensor_scale(2048 * 32, None, [theirs, theirs], scale)
        foreach_scale(2048 * 32, None, [ours, ours], scale)
        foreach_scale(2048 * 32, None, [grads, into], scale)
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(theirs, ours, into))


def test_the_first_step_is_adams_and_sharding_does_not_change_it(result) -> None:
    assert result["moved"] > 1000
    assert result["textbook_max_err"] < 1e-6  # a few float32 ulps of weights near 1; the step itself is lr = 1e-3
    # optim.router_lr_mult=10: the routers step at 10x the rate (their own parameter group), the rest as before
    assert result["routers"] > 0 and result["router_lr_mult_textbook_max_err"] < 1e-6
    assert result["auto_vs_sharded_max_diff"] < 1e-7
    assert result["fused_vs_foreach_max_diff"] < 1e-6  # two kernels, the same step (float rounding apart)


def test_overlapped_gradient_reduce_equals_it_off_whatever_the_micro_batch_count(tmp_path) -> None:
    """2 data-parallel ranks, steps of 3, 1 and 2 micro-batches, both optimizers: the
    weights after each step equal those of the same steps without overlap."""
    hf_dir = save_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", seed=3)
    result = run_check_script("overlap_checks.py", hf_dir)
    for sharded in (False, True):
        assert result[f"max_diff_distributed_{sharded}"] == [0.0, 0.0, 0.0], result
        assert min(result[f"moved_distributed_{sharded}"]) > 1000, result  # the steps did move the weights


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_the_finite_check_finds_any_nan_or_inf_in_any_gradient_buffer(bad) -> None:
    """(One process, no process group: the check's all-reduce is the identity.)"""
    from types import SimpleNamespace

    import torch

    from parallel.optim import _grads_finite

    dense, expert = torch.randn(1000), torch.randn(300)
    if bad is not None:
        expert[137] = bad
    chunk = SimpleNamespace(
        buffers=[SimpleNamespace(grad_data=dense)], expert_parallel_buffers=[SimpleNamespace(grad_data=expert)]
    )
    assert _grads_finite([chunk]) is (bad is None)
    assert _grads_finite([SimpleNamespace(buffers=[], expert_parallel_buffers=[])])
