"""The local engine's simulated train-inference mismatch (rollout.simulate_mismatch), checked
against an unperturbed copy of the same checkpoint (the trainer's side) on the same tokens."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_rl import tags
from moe_rl.checks import ConfigError
from moe_rl.config import load_config
from moe_rl.routing.drift import changed_frac
from moe_rl.routing.hf_routing import transformers_routing
from moe_rl.rollout.local import LocalEngine
from moe_rl.rollout.types import SamplingParams

TARGET = 0.15
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)
# softmax top-k (Qwen3-MoE), sigmoid scores with a bias and group-limited top-k (DeepSeek-V3, GLM-4.5)
ARCHITECTURES = ("qwen3_moe", "deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from moe_rl.models.tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("mismatch")
    return {arch: save_tiny_checkpoint(root / arch, arch, seed=5) for arch in ARCHITECTURES}


def prompts(seed: int, count: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 64) for _ in range(rng.choice((5, 6)))] for _ in range(count)]


def generate(engine: LocalEngine, seed: int):
    return [
        s for group in engine.generate(prompts(seed), 4, PARAMS, seed=seed, return_routed_experts=True) for s in group
    ]


def flips_against(reference: torch.nn.Module, samples, moe_layers: list[int]) -> torch.Tensor:
    """Per MoE layer: the share of response-predicting tokens whose engine top-k set differs
    from the unperturbed model's, teacher-forced on the same tokens."""
    engine, trainer = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.output_ids[:-1]])
        routed, _ = transformers_routing(reference, ids)
        start = len(s.prompt_ids) - 1
        engine.append(s.routed_experts[start:].long())
        trainer.append(routed[0, start:])
    return changed_frac(torch.cat(engine), torch.cat(trainer))[moe_layers]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_engine_reaches_the_target_flip_fraction_and_only_its_routers_change(checkpoints, arch) -> None:
    path = checkpoints[arch]
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    engine = LocalEngine(path, router_flip_frac=TARGET, mismatch_seed=3)
    moe_layers = engine._routers.moe_layers
    generate(engine, 1)  # calibrated on the prompts; what it generated is what it calibrates on next
    engine.update_weights_from_disk(path, "1")  # a weight update: calibrated again, on the last samples
    engine.rollout_scalars()
    samples = generate(engine, 2)
    measured = flips_against(reference, samples, moe_layers)
    assert ((measured - TARGET).abs() <= 0.35 * TARGET).all(), measured
    reported = engine.rollout_scalars()
    for i, layer in enumerate(moe_layers):  # the engine reports what an independent recount finds
        assert reported[tags.simulated_mismatch("flip_frac", layer)] == pytest.approx(float(measured[i]), abs=0.02)
    assert reported[tags.SIMULATED_TARGET_FLIP_FRAC] == TARGET and reported[tags.SIMULATED_KL_K3] > 0
    assert reported[tags.SIMULATED_ANY_LAYER_FLIPPED_FRAC] >= max(measured)
    # only the engine's router weights differ from the checkpoint's, and back exactly when unperturbed
    want = reference.state_dict()
    gates = {f"model.layers.{l}.mlp.gate.weight" for l in moe_layers}
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, want[name]) != (name in gates), name
    with engine.mismatch.unperturbed():
        assert all(torch.equal(engine.model.state_dict()[g], want[g]) for g in gates)
    # the perturbed forward is what produced the log-probs: they differ from the unperturbed model's
    s = max(samples, key=lambda s: len(s.output_ids))
    ids = torch.tensor([s.prompt_ids + s.output_ids])
    with torch.no_grad():
        clean = torch.log_softmax(reference(ids).logits[0, len(s.prompt_ids) - 1 : -1], -1)
    clean = clean.gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
    assert not torch.allclose(clean, torch.tensor(s.output_logprobs), atol=1e-6)


def test_the_simulation_is_reproducible_per_seed_and_off_by_default(checkpoints) -> None:
    path = checkpoints["qwen3_moe"]
    runs = []
    for seed in (3, 3, 4):
        engine = LocalEngine(path, router_flip_frac=TARGET, mismatch_seed=seed)
        runs.append([(s.output_ids, s.output_logprobs, s.routed_experts.tolist()) for s in generate(engine, 1)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    plain = LocalEngine(path)
    generate(plain, 1)
    assert plain.mismatch is None and plain.rollout_scalars() == {}


def test_simulate_mismatch_settings_are_checked() -> None:
    cfg = load_config(None, ["rollout.simulate_mismatch.router_flip_frac=0.1"])
    assert cfg.rollout.simulate_mismatch.enabled
    with pytest.raises(ConfigError, match=r"router_flip_frac=1.5 must be in \[0, 1\)"):
        load_config(None, ["rollout.simulate_mismatch.router_flip_frac=1.5"])
    with pytest.raises(ConfigError, match="local engine only"):
        load_config(
            None,
            [
                "rollout.simulate_mismatch.router_flip_frac=0.1",
                "rollout.engine=sglang",
                "rollout.sglang_urls=[http://h:1]",
            ],
        )


def test_the_report_states_the_regime_reached_per_layer() -> None:
    from moe_rl.report import regime_section

    def run(engine: tuple[float, float], trainer: tuple[float, float]) -> dict:
        steps = lambda v: {1: v, 2: v}  # noqa: E731
        out = {tags.SIMULATED_TARGET_FLIP_FRAC: steps(0.1)}
        for layer, (e, t) in enumerate(zip(engine, trainer)):
            out[tags.simulated_mismatch("flip_frac", layer)] = steps(e)
            out[tags.routing("changed_frac", "train_vs_rollout", layer)] = steps(t)
        return out

    # R3's run (trainer 0: it replays the engine) is left out of the trainer's column, and a
    # control run without the simulation (no target logged) out of every column
    control = {tags.routing("changed_frac", "train_vs_rollout", layer): {1: 0.004} for layer in (0, 1)}
    section = regime_section(
        {"grpo": run((0.09, 0.13), (0.11, 0.15)), "grpo_r3": run((0.11, 0.13), (0.0, 0.0)), "control": control}
    )
    assert "| 0 | 0.100 | 0.100 | 0.110 | yes |" in section and "| 1 | 0.100 | 0.130 | 0.150 | no |" in section
    assert "A simulation" in section
    assert regime_section({"grpo": {tags.TRAIN_LOSS: {1: 0.0}}}) == ""


def test_a_compare_config_names_its_claim_set() -> None:
    from moe_rl.claims import CLAIM_SETS
    from moe_rl.commands.compare import _shape_problem

    assert _shape_problem({"claims": "scale_regime", "runs": {}}) is None
    assert "must be one of papers, scale_regime" in _shape_problem({"claims": "mine", "runs": {}})
    runs = {r for c in CLAIM_SETS["scale_regime"] for cmp in c.comparisons for r in (cmp.a.run, cmp.b.run)}
    import yaml
    from pathlib import Path

    spec = yaml.safe_load((Path(__file__).parents[1] / "configs/compare/scale_regime.yaml").read_text())
    assert spec["claims"] == "scale_regime" and runs <= set(spec["runs"])  # every claim has its runs
