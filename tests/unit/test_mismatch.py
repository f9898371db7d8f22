"""The local engine's simulated train-inference mismatch (rollout.simulate_mismatch), checked
against an unperturbed copy of the same checkpoint (the trainer's side) on the same tokens, and
against the routers' gate formulas written out here from transformers' code."""

from __future__ import annotations

import contextlib
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
from moe_rl.rollout.settings import SimulatedMismatch
from moe_rl.rollout.types import SamplingParams

TARGET = 0.15
LOGIT_KL = 2e-3
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)
# softmax top-k (Qwen3-MoE), sigmoid scores with a bias and group-limited top-k (DeepSeek-V3, GLM-4.5)
ARCHITECTURES = ("qwen3_moe", "deepseek_v3", "glm4_moe")
SIGMOID = ("deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from moe_rl.models.tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("mismatch")
    paths = {arch: save_tiny_checkpoint(root / arch, arch, seed=5) for arch in ARCHITECTURES}
    # larger weights: experts that matter, so that flipping them costs KL (at the default init they barely do)
    paths["qwen3_moe_wide"] = save_tiny_checkpoint(root / "wide", "qwen3_moe", seed=5, initializer_range=0.1)
    return paths


def prompts(seed: int, count: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 64) for _ in range(rng.choice((5, 6)))] for _ in range(count)]


def generate(engine: LocalEngine, seed: int, count: int = 24):
    return [
        s
        for group in engine.generate(prompts(seed, count), 4, PARAMS, seed=seed, return_routed_experts=True)
        for s in group
    ]


def calibrated(path: str, **settings) -> LocalEngine:
    """An engine that has calibrated twice: on a trial generation, then after a weight update on
    what it generated (as in training); its tally emptied."""
    engine = LocalEngine(path, mismatch=SimulatedMismatch(**settings), mismatch_seed=3)
    generate(engine, 1)
    engine.update_weights_from_disk(path, "1")
    engine.rollout_scalars()
    return engine


def clean_gates(logits: torch.Tensor, experts: torch.Tensor, cfg) -> torch.Tensor:
    """The gate values a router gives ``experts`` ``[T, k]`` from its ``logits`` ``[T, E]``, as
    transformers' routers compute them for the experts they choose: softmax, renormalised
    over the k when ``norm_topk_prob`` (Mixtral always); sigmoid (DeepSeek-V3, GLM-4.5),
    renormalised, times ``routed_scaling_factor`` (the bias only chooses)."""
    logits = logits.float()
    if cfg.model_type in SIGMOID:
        gates = torch.sigmoid(logits).gather(1, experts)
        return gates / gates.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    gates = torch.softmax(logits, -1).gather(1, experts)
    renormalised = cfg.model_type == "mixtral" or cfg.norm_topk_prob
    return gates / gates.sum(-1, keepdim=True) if renormalised else gates


def gates_of(model) -> dict[int, torch.nn.Module]:
    return {l: layer.mlp.gate for l, layer in enumerate(model.get_decoder().layers) if hasattr(layer.mlp, "gate")}


@contextlib.contextmanager
def forced_routing(model, experts: torch.Tensor):
    """``model``'s routers made to use ``experts`` ``[s, L, k]`` (one row) with the gate values
    :func:`clean_gates` gives them from the router's own logits: what a trainer replaying the
    engine's routing (R3) computes."""

    def hook(layer):
        def replace(module, args, output):
            logits = output[0]
            chosen = experts[:, layer].long()
            return logits, clean_gates(logits, chosen, model.config).to(output[1].dtype), chosen

        return replace

    handles = [gate.register_forward_hook(hook(l)) for l, gate in gates_of(model).items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def teacher_forced(model, sample, capture_hidden: bool = False):
    """Log-probs ``[n]`` of the sample's output tokens under ``model`` (and the last hidden
    states of the positions that predict them)."""
    ids = torch.tensor([sample.prompt_ids + sample.output_ids[:-1]])
    out = model(ids, output_hidden_states=capture_hidden)
    span = slice(len(sample.prompt_ids) - 1, None)
    logp = torch.log_softmax(out.logits[0, span].float(), -1)
    drawn = logp.gather(1, torch.tensor(sample.output_ids)[:, None]).squeeze(1)
    return (drawn, out.logits[0, span], out.hidden_states[-1][0, span]) if capture_hidden else drawn


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


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen3_moe", {"norm_topk_prob": False}),
        ("qwen3_moe", {"norm_topk_prob": True}),
        ("mixtral", {}),
        ("deepseek_v3", {}),  # 8 experts in 2 groups, one group per token
        ("glm4_moe", {"n_group": 2, "topk_group": 1}),
    ],
)
def test_a_noisy_choice_keeps_each_routers_own_gate_formula(arch, overrides) -> None:
    from moe_rl.models.architectures import architecture_of
    from moe_rl.models.tiny import _TINY, tiny_config
    from moe_rl.routing.scores import route_with_noisy_choice

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(0)
    model = _TINY[arch][1](cfg).eval()
    gate = next(iter(gates_of(model).values()))
    arch_ = architecture_of(cfg)
    bias = None
    if arch_.has_expert_bias(cfg):
        bias = gate.e_score_correction_bias
        bias.copy_(0.05 * torch.randn(bias.shape))
    with torch.no_grad():
        gate.weight.normal_(0, 0.3)
        logits, weights, experts = gate(torch.randn(256, cfg.hidden_size))
        sort = lambda g, e: (g.gather(1, e.argsort(-1)), e.sort(-1).values)  # noqa: E731
        # no noise: the router's own output (as sets, with their gates)
        got_g, got_e = sort(
            *route_with_noisy_choice(logits, torch.zeros_like(logits), cfg.num_experts_per_tok, arch_.router(cfg), bias)
        )
        want_g, want_e = sort(weights.float(), experts)
        assert torch.equal(got_e, want_e) and torch.allclose(got_g, want_g, atol=1e-6)
        # noise: other experts for many tokens, gates still the clean logits' at them
        noise = 0.5 * torch.randn_like(logits)
        gates, chosen = route_with_noisy_choice(logits, noise, cfg.num_experts_per_tok, arch_.router(cfg), bias)
    flipped = (chosen.sort(-1).values != want_e).any(-1)
    assert 0.2 < flipped.float().mean() < 1.0
    assert torch.allclose(gates, clean_gates(logits, chosen, cfg), atol=1e-6)
    groups = getattr(cfg, "n_group", 1) or 1
    if groups > 1:  # the noise enters before the group selection: the group itself can flip
        group_of = lambda e: e // (arch_.num_experts(cfg) // groups)  # noqa: E731
        assert (group_of(chosen) == group_of(chosen[:, :1])).all()  # still one group per token (topk_group=1)
        assert (group_of(chosen[:, 0]) != group_of(want_e[:, 0])).any()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_selection_only_mismatch_flips_at_the_target_with_clean_gates_and_r3_replays_it(checkpoints, arch) -> None:
    """Selection mode with the logit part on: the engine's routing flips at the target per layer
    (an independent recount), its gate values at the experts it chose are the clean router's,
    no weight changes, and a trainer replaying its routing (R3) computes its log-probs up to the
    logit perturbation exactly."""
    path = checkpoints[arch]
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    engine = calibrated(path, router_flip_frac=TARGET, logit_kl=LOGIT_KL)
    moe_layers = engine._routers.moe_layers
    samples = generate(engine, 2, count=48)
    measured = flips_against(reference, samples, moe_layers)  # calibrated on other samples: within 40%
    assert ((measured - TARGET).abs() <= 0.4 * TARGET).all(), measured
    reported = engine.rollout_scalars()
    for i, layer in enumerate(moe_layers):  # the engine reports what an independent recount finds
        assert reported[tags.simulated_mismatch("flip_frac", layer)] == pytest.approx(float(measured[i]), abs=0.02)
    assert reported[tags.SIMULATED_TARGET_FLIP_FRAC] == TARGET
    assert reported[tags.SIMULATED_ANY_LAYER_FLIPPED_FRAC] >= max(measured)
    assert reported[tags.SIMULATED_LOGIT_KL] == pytest.approx(LOGIT_KL, rel=0.3)
    want = reference.state_dict()  # nothing of the engine's weights changes
    assert all(torch.equal(t, want[name]) for name, t in engine.model.state_dict().items())
    # the gate values the engine's experts get are the clean router's at the experts it chose
    seen = {}
    layers = engine.model.get_decoder().layers
    hooks = [
        hook
        for l in moe_layers
        for hook in (
            layers[l].mlp.gate.register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(("in", l), a[0])),
            layers[l].mlp.experts.register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(("out", l), a[1:3])),
        )
    ]
    flipped = 0
    for s in samples[:8]:
        with torch.no_grad():
            engine.model(torch.tensor([s.prompt_ids + s.output_ids[:-1]]))
        for l in moe_layers:
            experts, gates = seen[("out", l)]
            router_input = seen[("in", l)].reshape(experts.shape[0], -1)
            clean_logits = router_input.float() @ want[f"model.layers.{l}.mlp.gate.weight"].float().T
            assert torch.allclose(gates.float(), clean_gates(clean_logits, experts, engine.model.config), atol=1e-5)
            unbiased_choice = clean_logits.topk(experts.shape[1]).indices.sort(-1).values
            flipped += int((experts.sort(-1).values != unbiased_choice).any(-1).sum())
    for h in hooks:
        h.remove()
    engine._routers.clear()
    if arch not in SIGMOID:  # (a sigmoid router's bias also picks: its clean top-k is not the logits')
        assert flipped > 0
    # R3: the clean model on the engine's routing, plus the engine's logit perturbation, is the engine
    noise = engine.mismatch.logits
    for s in samples[:8]:
        with forced_routing(reference, s.routed_experts):
            replayed, logits, hidden = teacher_forced(reference, s, capture_hidden=True)
        with_noise = torch.log_softmax(logits.float() + noise.scale * noise.noise(hidden), -1)
        with_noise = with_noise.gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(with_noise, torch.tensor(s.output_logprobs), atol=2e-5)
        assert not torch.allclose(replayed, torch.tensor(s.output_logprobs), atol=1e-4)  # the logit part remains


def test_the_simulation_is_reproducible_per_seed_replays_exactly_without_logit_noise_and_is_off_by_default(
    checkpoints,
) -> None:
    path = checkpoints["qwen3_moe"]
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    runs = []
    for seed in (3, 3, 4):
        engine = LocalEngine(path, mismatch=SimulatedMismatch(router_flip_frac=TARGET), mismatch_seed=seed)
        samples = generate(engine, 1)
        runs.append([(s.output_ids, s.output_logprobs, s.routed_experts.tolist()) for s in samples])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    for s in samples[:8]:  # routing only: R3 leaves nothing of the mismatch
        with forced_routing(reference, s.routed_experts):
            assert torch.allclose(teacher_forced(reference, s), torch.tensor(s.output_logprobs), atol=2e-5)
    plain = LocalEngine(path)
    generate(plain, 1)
    assert plain.mismatch is None and plain.rollout_scalars() == {}


def test_the_logit_part_moves_the_draws_and_the_reported_logprobs_alike(checkpoints) -> None:
    """Logit noise alone: no routing changes, the KL reaches its target, and the engine samples
    from the distribution whose log-probs it reports (not the clean one)."""
    path = checkpoints["qwen3_moe"]
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    engine = calibrated(path, logit_kl=LOGIT_KL)
    samples = generate(engine, 2, count=48)
    reported = engine.rollout_scalars()
    assert reported[tags.SIMULATED_LOGIT_KL] == pytest.approx(LOGIT_KL, rel=0.3)
    assert reported[tags.SIMULATED_ROUTING_KL] == 0 and reported[tags.SIMULATED_ANY_LAYER_FLIPPED_FRAC] == 0
    assert reported[tags.SIMULATED_KL_K3] == pytest.approx(LOGIT_KL, rel=0.5)  # the drawn tokens' estimate
    assert (flips_against(reference, samples[:8], engine._routers.moe_layers) == 0).all()
    plain = [s.output_ids for s in generate(LocalEngine(path), 2, count=48)]
    assert plain != [s.output_ids for s in samples]  # the same uniforms drew other tokens somewhere
    noise = engine.mismatch.logits
    for s in samples[:8]:
        clean, logits, hidden = teacher_forced(reference, s, capture_hidden=True)
        perturbed = torch.log_softmax(logits.float() + noise.scale * noise.noise(hidden), -1)
        perturbed = perturbed.gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(perturbed, torch.tensor(s.output_logprobs), atol=2e-5)


def test_a_routing_kl_target_lets_the_flips_float_and_evaluation_runs_clean(checkpoints) -> None:
    path = checkpoints["qwen3_moe_wide"]
    target = 1e-3
    engine = calibrated(path, routing_kl=target)
    generate(engine, 2, count=48)
    reported = engine.rollout_scalars()
    assert reported[tags.SIMULATED_TARGET_ROUTING_KL] == target
    assert 0.5 * target <= reported[tags.SIMULATED_ROUTING_KL] <= 2 * target  # heavy-tailed per token
    scales = [reported[tags.simulated_mismatch("scale", l)] for l in engine._routers.moe_layers]
    assert len(set(scales)) == 1 and reported[tags.simulated_mismatch("flip_frac")] > 0
    # evaluation: the trained model's own samples, nothing tallied or pooled
    pool = list(engine.mismatch._pool)
    with engine.evaluation():
        evaluated = generate(engine, 5)
    plain = generate(LocalEngine(path), 5)
    assert [(s.output_ids, s.output_logprobs) for s in evaluated] == [(s.output_ids, s.output_logprobs) for s in plain]
    assert engine.rollout_scalars() == {} and engine.mismatch._pool == pool


def test_weight_mode_perturbs_only_the_router_weights(checkpoints) -> None:
    path = checkpoints["qwen3_moe"]
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    engine = calibrated(path, mode="weights", router_flip_frac=TARGET)
    moe_layers = engine._routers.moe_layers
    measured = flips_against(reference, generate(engine, 2, count=48), moe_layers)
    assert ((measured - TARGET).abs() <= 0.4 * TARGET).all(), measured
    want = reference.state_dict()
    gates = {f"model.layers.{l}.mlp.gate.weight" for l in moe_layers}
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, want[name]) != (name in gates), name
    with engine.mismatch.unperturbed():
        assert all(torch.equal(engine.model.state_dict()[g], want[g]) for g in gates)


def test_the_scale_search_meets_its_target_in_few_measurements() -> None:
    from moe_rl.rollout.scale_search import SCALE_RANGE, solve_scale

    calls = []

    def kl(scale: float) -> float:  # a KL: about quadratic, not exactly
        calls.append(scale)
        return 3e-2 * scale**2.3

    found = solve_scale(kl, 7.5e-4, 1.0, tolerance=0.02, exponent=2.0)
    assert found.reached and abs(found.value / 7.5e-4 - 1) <= 0.02 and found.measurements == len(calls) <= 5
    # a flip fraction: nothing flips below a threshold, then it grows and saturates
    flips = lambda scale: min(1.0, max(0.0, scale - 0.02) * 4)  # noqa: E731
    found = solve_scale(flips, 0.1, 1e-4, tolerance=0.03, exponent=1.0)
    assert found.reached and abs(found.value - 0.1) <= 0.003
    assert solve_scale(flips, 0.1, found.scale, tolerance=0.03, exponent=1.0).measurements == 1  # the last scale holds
    out_of_reach = solve_scale(lambda s: min(s, 0.05), 0.1, 1.0, tolerance=0.03, exponent=1.0)
    assert not out_of_reach.reached and out_of_reach.scale == pytest.approx(SCALE_RANGE[1])


def test_simulate_mismatch_settings_are_checked() -> None:
    cfg = load_config(None, ["rollout.simulate_mismatch.router_flip_frac=0.1"])
    assert cfg.rollout.simulate_mismatch.enabled and cfg.rollout.simulate_mismatch.mode == "selection"
    assert load_config(None, ["rollout.simulate_mismatch.logit_kl=1e-3"]).rollout.simulate_mismatch.enabled
    for bad, match in [
        ("router_flip_frac=1.5", r"router_flip_frac=1.5 must be in \[0, 1\)"),
        ("logit_kl=-1", r"logit_kl=-1.0 must be in \[0, 1\)"),
        ("mode=gates", "mode='gates' is not valid; valid: selection, weights"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [f"rollout.simulate_mismatch.{bad}"])
    with pytest.raises(ConfigError, match="router_flip_frac and rollout.simulate_mismatch.routing_kl both set"):
        load_config(
            None, ["rollout.simulate_mismatch.router_flip_frac=0.1", "rollout.simulate_mismatch.routing_kl=1e-3"]
        )
    with pytest.raises(ConfigError, match="local engine only"):
        load_config(
            None,
            [
                "rollout.simulate_mismatch.router_flip_frac=0.1",
                "rollout.engine=sglang",
                "rollout.server.urls=[http://h:1]",
            ],
        )


def test_the_report_states_the_regime_reached_beside_the_papers_figures() -> None:
    from moe_rl.report import regime_section

    kl = tags.train("offpolicy/kl_k3")

    def run(flips: tuple[float, float], trainer: tuple[float, float], kls: list[float]) -> dict:
        steps = lambda v: {1: v, 2: v, 3: v}  # noqa: E731
        out = {
            tags.SIMULATED_TARGET_FLIP_FRAC: {1: 0.1, 2: 0.2, 3: 0.3},  # floating: routing_kl set
            tags.SIMULATED_TARGET_ROUTING_KL: steps(8e-4),
            tags.SIMULATED_TARGET_LOGIT_KL: steps(7.5e-4),
            kl: dict(enumerate(kls, 1)),
            tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED: steps(sum(trainer) / 2),
        }
        for layer, (e, t) in enumerate(zip(flips, trainer)):
            out[tags.simulated_mismatch("flip_frac", layer)] = steps(e)
            out[tags.routing("changed_frac", "train_vs_rollout", layer)] = steps(t)
        return out

    # R3's run (trainer 0: it replays the engine) is left out of the trainer's column and is the "with R3"
    # column; a control run without the simulation (no target logged) only has its own KL column
    control = {kl: {1: 1e-5, 2: 3e-5, 3: 2e-5}, tags.ROUTING_TRAIN_VS_ROLLOUT_CHANGED: {1: 0.004}}
    section = regime_section(
        {
            "grpo": run((0.09, 0.13), (0.11, 0.15), [1e-3, 2e-3, 9e-3]),
            "grpo_r3": run((0.11, 0.13), (0.0, 0.0), [7e-4, 8e-4, 7.5e-4]),
            "control": control,
        }
    )
    assert "| 0 | 0.200 | 0.100 | 0.110 |" in section and "| 1 | 0.200 | 0.130 | 0.150 |" in section
    # the KL: each run's median over steps (mean over steps on the next row), the paper's beside them
    assert (
        f"| train-inference KL, k3 (`{kl}`), median over steps | 0.00200 | 0.000750 | 2.00e-05 | 0.001535 | 0.00075 |"
        in section
    )
    assert "| the same, mean over steps | 0.00400 | 0.000750 | 2.00e-05 |" in section
    assert "A simulation" in section and "a KL of 0.000800 per token" in section
    assert regime_section({"grpo": {tags.TRAIN_LOSS: {1: 0.0}}}) == ""


def test_the_report_answers_whether_replay_is_needed_from_the_runs() -> None:
    from moe_rl.claims import replay_answer

    kl, held_out = tags.train("offpolicy/kl_k3"), tags.eval_pass_at(1)

    def run(kls: list[float], pass1: float, simulated: bool = True) -> dict:
        out = {kl: dict(enumerate(kls, 1)), held_out: {0: 0.5, 5: pass1, 10: pass1}}
        return {**out, tags.SIMULATED_TARGET_LOGIT_KL: {1: 7.5e-4}} if simulated else out

    def runs(r3_gain: float) -> dict:
        out = {}
        for seed, noise in zip((1, 2, 3), (0.0, 0.01, -0.01)):
            out[f"grpo_s{seed}"] = run([1e-3, 2e-3, 9e-3], 0.60 + noise)
            out[f"grpo_r3_s{seed}"] = run([7e-4, 8e-4, 7.5e-4], 0.60 + noise + r3_gain + 0.001 * seed)
            out[f"grpo_no_mismatch_s{seed}"] = run([1e-5, 1e-5, 1e-5], 0.60 + noise + r3_gain, simulated=False)
        return out

    same = " ".join(replay_answer(runs(0.0), [1, 2, 3]))
    # each seed's median KL: 2e-3 (GRPO) and 7.5e-4 (R3); held-out: the mean of the evaluations after step 0
    assert "from 0.0020 to 0.00075 per token (R3 paper: 0.001535 to 0.00075)" in same
    assert "from 0.600 (GRPO) to 0.602" in same and same.endswith("won none back: here, no.")
    assert " ".join(replay_answer(runs(0.1), [1, 2, 3])).endswith(
        "won back held-out accuracy the mismatch cost: here, yes."
    )
    assert replay_answer({"grpo": run([1e-3], 0.6, simulated=False), "grpo_r3": run([1e-3], 0.6)}) == []


def test_a_compare_config_names_its_claim_set() -> None:
    from moe_rl.claims import CLAIM_SETS
    from moe_rl.commands.compare import _shape_problem

    assert _shape_problem({"claims": "scale_regime", "runs": {}}) is None
    assert "must be one of papers, scale_regime" in _shape_problem({"claims": "mine", "runs": {}})
    runs = {r for c in CLAIM_SETS["scale_regime"] for cmp in c.comparisons for r in (cmp.a.run, cmp.b.run)}
    import yaml
    from pathlib import Path

    spec = yaml.safe_load((Path(__file__).parents[2] / "configs/compare/scale_regime.yaml").read_text())
    assert spec["claims"] == "scale_regime" and runs <= set(spec["runs"])  # every claim has its runs
    assert _shape_problem(spec) is None and set(spec["more_seeds"]) <= runs
    # the long view is the same regime, only longer
    long = yaml.safe_load((Path(__file__).parents[2] / "configs/compare/scale_regime_long.yaml").read_text())
    assert _shape_problem(long) is None and long["runs"] == spec["runs"] and long["claims"] == "scale_regime"
    assert {k: v for k, v in long["base"].items() if k != "train"} == {
        k: v for k, v in spec["base"].items() if k != "train"
    }
    # more_seeds: the runs named get those seeds as well
    from moe_rl.commands.compare import seeded_runs

    seeded = seeded_runs({"a": {}, "b": {"x": 1}}, [1, 2], {"b": [2, 3]})
    assert list(seeded) == ["a_s1", "a_s2", "b_s1", "b_s2", "b_s3"] and seeded["b_s3"] == {"x": 1, "train": {"seed": 3}}
    assert "more_seeds must map run names" in _shape_problem({"runs": {"a": {}}, "more_seeds": {"c": [1]}})
