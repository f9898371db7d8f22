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


def test_the_first_step_is_adams_and_sharding_does_not_change_it(result) -> None:
    assert result["moved"] > 1000
    assert result["textbook_max_err"] < 1e-6  # a few float32 ulps of weights near 1; the step itself is lr = 1e-3
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
