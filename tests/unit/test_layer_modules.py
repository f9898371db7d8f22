"""The layer modules (model.experts, model.attention): every choice gives megatron's
SequentialMLP + local attention's log-probs and HF-named gradients on the same weights
(GroupedExperts bit for bit, SdpaAttention to float error), with the grouped matmul and
its fallback; SdpaAttention equals the local attention under each mask; StackedLinear is
one matmul per expert, including experts that get no rows; at EP = 1 the one-rank token
dispatcher equals megatron's and reads no device value on the host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import run_check_script
from moe_rl.models.grouped_experts import StackedLinear
from moe_rl.models.tiny import save_tiny_checkpoint


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    hf_dir = save_tiny_checkpoint(tmp_path_factory.mktemp("modules") / "hf", "qwen3_moe", seed=4)
    return run_check_script("layer_modules_checks.py", hf_dir)


@pytest.mark.parametrize(
    "variant", ["grouped_sdpa", "fallback_sdpa", "grouped_local", "sequential_sdpa", "grouped_sdpa_alltoall"]
)
@pytest.mark.distributed
def test_every_module_choice_gives_the_reference_model(result, variant: str) -> None:
    r, scale = result[variant], result["grad_max_abs"]
    assert scale > 1e-3
    exact = variant == "grouped_local"  # the experts alone: the same arithmetic
    assert r["logp_max_diff"] <= (0.0 if exact else 1e-5)
    assert r["grad_max_diff"] <= (0.0 if exact else 1e-5 * scale)


@pytest.mark.distributed
def test_the_chosen_modules_are_the_ones_that_ran(result) -> None:
    assert result["grouped_sdpa"]["grouped_matmuls"] == 4 and result["fallback_sdpa"]["grouped_matmuls"] == 0
    assert result["grouped_sdpa"]["sdpa_modules"] == 2 and result["grouped_local"]["sdpa_modules"] == 0


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "dispatcher"),
    [
        (1, 1, None, "allgather"),
        (2, 1, 1, "allgather"),
        (2, 1, None, "alltoall"),
        (1, 2, None, "alltoall"),
        (2, 2, 1, "alltoall"),
    ],
)
@pytest.mark.distributed
def test_allgather_dispatcher_only_where_every_rank_holds_every_expert_whole(
    tp: int, ep: int, etp: int | None, dispatcher: str
) -> None:
    from moe_rl.models.builder import token_dispatcher_type
    from parallel.layout import ParallelLayout

    assert token_dispatcher_type(ParallelLayout(tp=tp, ep=ep, etp=etp)) == dispatcher


@pytest.mark.distributed
def test_the_one_rank_dispatcher_given_at_ep_1_equals_megatrons_allgather_and_alltoall(result) -> None:
    """One process (EP = expert TP = 1): megatron builds its allgather dispatcher and moe-rl
    gives each MoE layer the sync-free one-rank dispatcher in its place; megatron's allgather
    and alltoall dispatchers give the same log-probs and gradients to the last bit."""
    assert result["grouped_sdpa"]["dispatchers"] == ["OneRankTokenDispatcher"]
    assert result["grouped_sdpa_megatron_allgather"]["dispatchers"] == ["MoEAllGatherTokenDispatcher"]
    assert result["grouped_sdpa_alltoall"]["dispatchers"] == ["MoEAlltoAllTokenDispatcher"]
    for other in ("grouped_sdpa_alltoall", "grouped_sdpa_megatron_allgather"):
        assert result[f"{other}_vs_one_rank"] == {"logp_max_diff": 0.0, "grad_max_diff": 0.0}
    # with TE's fused permutation (on wherever TE is) megatron's dispatcher stays: its combine
    # gives TE's unpermute the row map TE's permute made, which the one-rank one has not
    assert result["dispatchers_under_permute_fusion"] == ["MoEAllGatherTokenDispatcher"]


@pytest.mark.distributed
def test_a_step_at_ep_1_reads_no_device_value_on_the_host_per_moe_layer() -> None:
    """On the stand-in accelerator, experts on the grouped-matmul path: the one-rank
    dispatcher's forward + backward read nothing on the host (a step: the two grad norms of
    the dense and expert optimizers and the finite check); megatron's allgather dispatcher,
    which it replaces, reads the expert counts and two value-sized outputs per layer forward
    (each a device sync on a GPU)."""
    result = run_check_script("host_reads_checks.py")
    forwards = result["moe_layer_forwards"]
    assert result["one_rank"]["dispatcher"] == "OneRankTokenDispatcher"
    assert result["one_rank"]["forward_backward"] == {}
    assert result["one_rank"]["whole_step"] == {"item": 3}
    assert result["megatron_allgather"]["forward_backward"] == {"to_host": forwards, "output_size": 2 * forwards}
    assert result["routing_stats"] == {}  # the routing monitor's accumulation inside the pass: no sync either
    # R3's setup of engine routing (was a read per sequence) and a pass keeping the router
    # distributions in host memory for router_kl (was a blocking copy per micro-batch)
    assert result["replay_setup_and_probe"] == {}
    # every policy loss, inside the loss step of each micro-batch (GSPO's per-sequence
    # advantage check was a read; SAPO's temperatures were host tensors copied over)
    assert {"gspo", "gmpo", "gmpo_seqclip", "sapo", "grpo"} <= set(result["policy_losses"])
    assert all(reads == {} for reads in result["policy_losses"].values()), result["policy_losses"]


@pytest.mark.parametrize("mask", ["shared_causal", "copied_causal", "padding"])
@pytest.mark.distributed
def test_sdpa_attention_equals_megatrons_local_attention(result, mask: str) -> None:
    assert result["attention"][mask] < 1e-5


@pytest.mark.parametrize("grouped", [True, False])
def test_stacked_linear_is_one_matmul_per_expert(grouped: bool) -> None:
    config = SimpleNamespace(use_cpu_initialization=True, params_dtype=torch.float32)
    layer = StackedLinear(4, 8, 12, config, partition_dim=1)
    torch.nn.init.normal_(layer.weight)
    layer.grouped = layer.grouped and grouped
    counts = torch.tensor([3, 0, 5, 2])  # expert 1 gets no rows
    rows = torch.randn(10, 12, requires_grad=True)
    out = layer(rows, counts.cumsum(0).to(torch.int32), counts.tolist())
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    starts = [0, 3, 3, 8, 10]
    weight = layer.weight.detach().clone().requires_grad_()
    rows_ref = rows.detach().clone().requires_grad_()
    ref = torch.cat([rows_ref[starts[e] : starts[e + 1]] @ weight[e].T for e in range(4)])
    (ref * upstream).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(rows.grad, rows_ref.grad)
    torch.testing.assert_close(layer.weight.grad, weight.grad)
    assert layer.weight.grad[1].abs().sum() == 0


def test_causal_masks_of_every_length_share_a_few_allocations_and_stay_recognised() -> None:
    from moe_rl.models import layers
    from moe_rl.models.layers import causal_mask, is_shared_causal_mask

    device = torch.device("cpu")
    layers._CAUSAL_MASKS.pop(device, None)
    mask = causal_mask(5, device)
    assert mask.shape == (1, 1, 5, 5) and torch.equal(mask[0, 0], torch.ones(5, 5, dtype=torch.bool).triu(1))
    assert is_shared_causal_mask(mask) and is_shared_causal_mask(causal_mask(3, "cpu"))
    assert causal_mask(3, device).data_ptr() == mask.data_ptr()  # a view of the same memory
    assert not is_shared_causal_mask(mask.clone()) and not is_shared_causal_mask(mask.transpose(-1, -2))
    assert not is_shared_causal_mask(mask[..., :4, :3])  # not square
    # megatron's recompute (tensor_parallel.random.CheckpointFunction.backward) re-enters the
    # layer with torch.utils.checkpoint.detach_variable(saved inputs): still the shared mask
    from torch.utils.checkpoint import detach_variable

    (recomputed,) = detach_variable((mask,))
    assert recomputed is not mask and is_shared_causal_mask(recomputed)
    longer = causal_mask(7, device)  # grows to twice the length; the earlier mask stays recognised
    assert torch.equal(longer[0, 0], torch.ones(7, 7, dtype=torch.bool).triu(1)) and is_shared_causal_mask(mask)
    assert [m.shape[-1] for m in layers._CAUSAL_MASKS[device]] == [5, 10]
    for length in range(2, 11):
        assert causal_mask(length, device).data_ptr() in {m.data_ptr() for m in layers._CAUSAL_MASKS[device]}
    assert [m.shape[-1] for m in layers._CAUSAL_MASKS[device]] == [5, 10]


@pytest.mark.distributed
def test_transformer_engine_swaps_only_linears_and_core_attention(result) -> None:
    """The TE spec (built with TE's placeholder classes: no TE here) names TE's linears and
    fused attention where the local spec has megatron's, in every family's layers and
    experts module, and nothing else: norms, experts module, MLA's projections' roles stay."""
    allowed = {
        ("ColumnParallelLinear", "TE column-parallel linear"),
        ("RowParallelLinear", "TE row-parallel linear"),
        ("SdpaAttention", "TE attention"),
        ("LatentSdpaAttention", "TE attention"),
    }
    changes = {key: set(layer) for key, layer in result["transformer_engine_spec"].items()}
    for key, layer in result["transformer_engine_spec"].items():
        assert {tuple(pair) for pair in layer.values()} <= allowed, key
    attention = {"self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj"}
    # in every MoE spec, built where configured
    shared = {"mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"}
    assert changes["qwen3_moe/grouped/0"] == attention | shared  # GroupedExperts stays
    assert changes["qwen3_moe/sequential/0"] == attention | shared | {
        "mlp.experts.linear_fc1",
        "mlp.experts.linear_fc2",
    }
    assert {
        "mlp.linear_fc1",
        "mlp.linear_fc2",
        "self_attention.linear_kv_down_proj",
        "self_attention.core_attention",
    } <= changes["deepseek_v3/grouped/0"]


def test_auto_picks_transformer_engine_only_where_it_imports_and_a_gpu_is_present(monkeypatch) -> None:
    import megatron.core.extensions.transformer_engine as te_extension

    from moe_rl.models.layers import LayerModules

    assert not LayerModules(transformer_impl="auto").transformer_engine  # this machine: no TE, no GPU
    for have_te, gpu in ((True, False), (False, True), (True, True)):
        monkeypatch.setattr(te_extension, "HAVE_TE", have_te)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        assert LayerModules(transformer_impl="auto").transformer_engine == (have_te and gpu)
        assert (
            LayerModules(transformer_impl="transformer_engine").transformer_engine
            and not LayerModules().transformer_engine
        )
    with pytest.raises(ValueError, match="transformer_impl='te' is not one of"):
        LayerModules(transformer_impl="te")


@pytest.mark.parametrize(("family", "fusion"), [("qwen3_moe", "apply_rope_fusion"), ("deepseek_v3", "fused_permute")])
def test_transformer_engine_layers_ask_for_tes_fused_rope_and_permutation(family: str, fusion: str) -> None:
    """megatron-core refuses TE's fusions without TE: the config built for TE layers asks
    for fused RoPE (not under MLA: megatron's MLA one is training-only) and fused token
    permutation; the local config asks for neither."""
    from moe_rl.models.builder import make_transformer_config
    from moe_rl.models.layers import LayerModules
    from moe_rl.models.tiny import tiny_config
    from parallel.layout import ParallelLayout

    config = make_transformer_config(tiny_config(family), ParallelLayout())
    assert not config.apply_rope_fusion and not config.moe_permute_fusion
    with pytest.raises((ValueError, ImportError), match=fusion):
        make_transformer_config(
            tiny_config(family), ParallelLayout(), modules=LayerModules(transformer_impl="transformer_engine")
        )


@pytest.mark.parametrize(
    ("device", "dtype", "capability", "runs"),
    [
        ("cpu", torch.float32, None, True),
        ("cpu", torch.bfloat16, None, True),
        ("cuda", torch.bfloat16, (9, 0), True),
        ("cuda", torch.bfloat16, (10, 0), True),
        ("cuda", torch.bfloat16, (8, 0), False),
        ("cuda", torch.float32, (9, 0), False),
    ],
)
def test_grouped_matmul_runs_on_the_cpu_and_on_hopper_and_later_gpus_in_bf16(
    device, dtype, capability, runs: bool
) -> None:
    """torch's grouped_mm has CPU kernels and CUDA CUTLASS kernels for bf16 on SM90+
    (elsewhere it loops over groups after a host copy of the offsets)."""
    from moe_rl.models.grouped_experts import grouped_mm_runs

    assert grouped_mm_runs(device, dtype, capability) is runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_the_hf_formula_to_the_bit_forward_and_backward(dtype: torch.dtype) -> None:
    """torch's rms_norm (fused on CUDA) computes, on a CPU, exactly what the HF formula does:
    weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)."""
    from moe_rl.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(3)
    config = SimpleNamespace(params_dtype=dtype, sequence_parallel=False, use_cpu_initialization=True)
    norm = RMSNorm(config, 64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    x = torch.randn(5, 3, 64, generator=gen).to(dtype).requires_grad_()
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    upstream = torch.randn(expected.shape, generator=gen).to(dtype)
    want = torch.autograd.grad(expected, (x, norm.weight), upstream)
    got_out = norm(x)
    got = torch.autograd.grad(got_out, (x, norm.weight), upstream)
    assert torch.equal(got_out, expected)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.distributed
def test_the_output_weights_gradient_is_summed_over_chunks_in_fp32_under_ddp(result) -> None:
    """A bf16 output weight in megatron DDP, log-probs one position per chunk: its main_grad
    is the fp64 gradient to fp32 error (autograd's bf16 sum of the chunks was ~1e-2 off), no
    dummy gradient (NaN-filled there) reaches it, and a tied embedding's share still does."""
    grads = result["output_weight_grads"]
    assert grads["untied_main_grad_rel_err"] < 1e-5
    assert grads["untied_bf16_sum_rel_err"] > 100 * grads["untied_main_grad_rel_err"]
    assert grads["tied_main_grad_rel_err"] < 1e-2  # the embedding's share is bf16
    assert grads["tied_rel_err_if_embedding_share_lost"] > 0.5
    assert not grads["untied_grad_left"] and not grads["tied_grad_left"]
