"""moe_rl.models.memory_budget (``moe-rl budget``) against hand arithmetic (a tiny Qwen3-MoE counted by hand) and the
Qwen3-30B-A3B figures the example configs quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.commands.budget import budget_inputs
from moe_rl.models.memory_budget import (
    GB,
    Layout,
    ParamCounts,
    budget,
    count_params,
    layer_params,
    save_budget,
    stage_budget,
)

ROOT = Path(__file__).parents[2]
TINY = {
    "model_type": "qwen3_moe",
    "vocab_size": 10,
    "hidden_size": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "moe_intermediate_size": 3,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 8,
    "tie_word_embeddings": False,
}


def test_parameters_are_counted_as_by_hand() -> None:
    # per layer: q 4x4 + k 4x2 + v 4x2 + o 4x4 + q/k norms 2+2 = 52, two norms 8, router 4x4 = 16;
    # experts 4 x (gate_up 4x6 + down 3x4) = 144; embedding 10x4; lm_head 10x4 + final norm 4
    assert count_params(TINY) == ParamCounts(embedding=40, output=44, layers_dense=2 * 76, layers_expert=2 * 144)


def test_uneven_stages_hold_their_own_layers() -> None:
    # 3 layers, the first dense (an MLP of 3 x 4x8 = 96 in place of router and experts): pp=2 splits them 2 + 1
    config = {**TINY, "num_hidden_layers": 3, "mlp_only_layers": [0]}
    counts, layers = count_params(config), layer_params(config)
    assert layers == [(52 + 8 + 96, 0), (76, 144), (76, 144)]
    layout = Layout(world=2, pp=2, distributed_optimizer=False)
    first, last = (stage_budget(counts, layout, s, layers) for s in (0, 1))
    assert first["params_B"] * 1e9 == pytest.approx(156 + 76 + 144 + 40) and last["params_B"] * 1e9 == pytest.approx(
        76 + 144 + 44
    )
    assert budget(counts, layout, layers) == first


def test_per_rank_bytes_follow_the_layout() -> None:
    counts = ParamCounts(embedding=40, output=44, layers_dense=152, layers_expert=288)
    layout = Layout(world=4, pp=2, ep=2)  # dp 2, expert dp 1
    first, last = (stage_budget(counts, layout, s) for s in (0, 1))
    # stage 0: dense 152/2 + 40 = 116, experts 288/2/2 = 72 -> 188 held, 116/2 + 72 = 130 in the optimizer
    assert first["total_GB"] * GB == pytest.approx(188 * (2 + 4) + 130 * 12)
    # stage 1: dense 76 + 44 = 120 -> 192 held, 60 + 72 = 132 sharded: the larger stage
    assert last["total_GB"] * GB == pytest.approx(192 * 6 + 132 * 12) and budget(counts, layout) == last
    unsharded = stage_budget(counts, Layout(world=4, pp=2, ep=2, distributed_optimizer=False), 1)
    assert unsharded["optimizer_GB"] * GB == pytest.approx(192 * 12)


def test_save_memory_for_both_checkpoint_sharding_types() -> None:
    counts = ParamCounts(embedding=40, output=44, layers_dense=152, layers_expert=288)
    layout = Layout(world=4, pp=2, ep=2)  # stage 1: dense 120 held over dp 2, experts 72 over expert dp 1
    full, by_rank = (save_budget(counts, layout, 1, reshardable=r) for r in (True, False))
    # each rank stages its write share: dense / dp + experts / expert dp, bf16 weights + fp32 master and moments
    assert full["staged_GB"] * GB == pytest.approx((60 + 72) * 14) and by_rank["staged_GB"] == full["staged_GB"]
    # fully_reshardable: every held parameter's state gathered to host on every rank; the dense
    # buffer's all-gather (one bucket) on the GPU: 4 bytes x 120 received + 60 sent
    assert full["gathered_GB"] * GB == pytest.approx(192 * 12)
    assert full["gpu_transient_GB"] * GB == pytest.approx(120 * 4 * 1.5)
    assert full["host_peak_GB"] * GB == pytest.approx(192 * 12 + 132 * 14)
    # dp_reshardable: no gather
    assert (
        by_rank["gathered_GB"] == by_rank["gpu_transient_GB"] == 0 and by_rank["host_peak_GB"] == by_rank["staged_GB"]
    )
    # buckets of at least 40M parameters: the same for a model this small
    assert save_budget(counts, Layout(world=4, pp=2, ep=2, overlap_grad_reduce=True), 1) == full
    # the plain optimizer gathers nothing
    plain = save_budget(counts, Layout(world=4, pp=2, ep=2, distributed_optimizer=False), 1)
    assert plain["gathered_GB"] == 0 and plain["host_peak_GB"] == plain["staged_GB"]


def test_the_example_configs_quote_the_tools_figures() -> None:
    qwen = count_params(json.loads((ROOT / "configs/examples/qwen3_30b_a3b.config.json").read_text()))
    olmoe = count_params(json.loads((ROOT / "configs/examples/olmoe_1b_7b.config.json").read_text()))
    assert qwen.total / 1e9 == pytest.approx(30.53, abs=0.01)  # Qwen3-30B-A3B
    assert olmoe.total / 1e9 == pytest.approx(6.92, abs=0.01)  # OLMoE-1B-7B
    for name, world, counts, model in (
        ("qwen3_30b_a3b_colocated_1x8", 8, qwen, "qwen3_30b_a3b"),
        ("qwen3_30b_a3b_disaggregated_2x8", 8, qwen, "qwen3_30b_a3b"),
        ("qwen3_30b_a3b_2x8", 16, qwen, "qwen3_30b_a3b"),
        ("sglang_local_server", 4, olmoe, "olmoe_1b_7b"),
    ):
        path = ROOT / "configs/examples" / f"{name}.yaml"
        layout, _ = budget_inputs(str(path), world, str(ROOT / "configs/examples" / f"{model}.config.json"))
        total = budget(counts, layout)["total_GB"]
        assert f"= {total:.1f} GB" in path.read_text(), (name, round(total, 1))


def test_the_budget_command_prints_each_stage_and_refuses_a_bad_world_in_one_line() -> None:
    config = ROOT / "configs/examples/qwen3_30b_a3b_2x8.yaml"
    hf = ROOT / "configs/examples/qwen3_30b_a3b.config.json"
    run = [sys.executable, "-m", "moe_rl.cli", "budget", "--config", str(config), "--hf-config", str(hf)]
    out = subprocess.run([*run, "--world", "16"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    layout, hf_config = budget_inputs(str(config), 16, str(hf))
    stage0 = stage_budget(count_params(hf_config), layout, 0, layer_params(hf_config))
    assert "30.53B parameters" in out.stdout and f"= {stage0['total_GB']:.1f} GB static per GPU" in out.stdout
    assert out.stdout.count("  stage ") == layout.pp
    bad = subprocess.run([*run, "--world", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "on --world 3: world size 3 is not divisible by tp*pp" in bad.stderr.strip().splitlines()[-1]


def test_a_tied_embedding_is_counted_once_and_held_twice_only_across_stages() -> None:
    tied = count_params({**TINY, "tie_word_embeddings": True})
    assert tied == ParamCounts(embedding=40, output=4, layers_dense=152, layers_expert=288, tied_output=40)
    assert tied.total == 40 + 4 + 152 + 288
    one_stage = stage_budget(tied, Layout(world=1, distributed_optimizer=False), 0)
    assert one_stage["params_B"] * 1e9 == pytest.approx(tied.total)  # megatron allocates no output weight
    last = stage_budget(tied, Layout(world=2, pp=2, distributed_optimizer=False), 1)
    assert last["params_B"] * 1e9 == pytest.approx(76 + 144 + 4 + 40)  # the last stage's copy


def test_the_distributed_optimizer_is_decided_as_the_trainer_decides_it() -> None:
    from moe_rl.models.memory_budget import layout_of
    from parallel.layout import ParallelLayout
    from parallel.optim import OptimSettings

    assert not layout_of(ParallelLayout(), OptimSettings(), 1).distributed_optimizer  # nothing to shard
    assert layout_of(ParallelLayout(ep=8), OptimSettings(), 8).distributed_optimizer  # dp 8
    assert not layout_of(ParallelLayout(ep=8), OptimSettings(use_distributed_optimizer=False), 8).distributed_optimizer


@pytest.mark.parametrize(
    "config_text, world, message",
    [
        ("parallel: {tp: [", 8, "is not valid YAML"),
        ("- a\n- b\n", 8, "must hold a mapping at the top level"),
        ("parallel: {ep: 8}\n", 0, "world size 0 must be >= 1"),
        ("parallel: {tp: 0}\n", 8, "parallel.tp=0 must be a positive integer"),
        ("parallel: {ep: 3}\n", 12, "model.num_experts"),
        ("parallel: {ep: 8}\noptim: {extra: {foo: 1}}\n", 8, "optim.extra.foo is not a field"),
        ("parallel: {tp: 2, pp: 1, first_stage_layers: 1}\n", 8, "first_stage_layers"),
    ],
)
def test_the_budget_command_refuses_bad_input_in_one_line(
    tmp_path: Path, config_text: str, world: int, message: str
) -> None:
    from conftest import moe_rl_in_process

    path = tmp_path / "c.yaml"
    path.write_text(config_text)
    hf = str(ROOT / "configs/examples/qwen3_30b_a3b.config.json")
    out = moe_rl_in_process("budget", "--config", str(path), "--world", str(world), "--hf-config", hf)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
