"""``moe-rl drift --engine``: train-inference routing drift between an SGLang-protocol
server with bf16 weights and the trainer's megatron model, checked against an independent
reference (transformers' fp32 routing and log-probs of the very samples the server made)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import STAND_IN_SERVER, moe_rl
from moe_rl.models.tiny import save_tiny_checkpoint
from moe_rl.rollout.sglang.engine import SGLangEngine
from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
from moe_rl.rollout.types import SamplingParams
from moe_rl.routing.drift import drift_metrics
from parallel.launch import free_port

SERVER = STAND_IN_SERVER
LAYERS, TOP_K, EXPERTS = 3, 4, 16  # many experts with a random router: bf16 rounding flips some choices
SAMPLES, NEW_TOKENS = 2, 16


def test_engine_drift_equals_a_transformers_reference(tmp_path: Path) -> None:
    model = save_tiny_checkpoint(
        tmp_path / "hf", "qwen3_moe", seed=5, num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(6)] for _ in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    settings = ServerSettings(
        model_path=model,
        port=free_port(),
        return_routed_experts=True,
        deterministic=True,
        launch_command=SERVER,
        extra_args=["--precision", "bf16"],
    )
    server = SGLangServer(settings, tmp_path / "logs")
    try:
        server.wait_healthy(timeout_s=120)
        out = moe_rl(
            "drift",
            "--engine",
            server.url,
            "--checkpoint",
            model,
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--samples",
            str(SAMPLES),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--out",
            str(tmp_path / "out"),
        )
        assert out.returncode == 0, out.stderr[-3000:]
        # the same requests again (a deterministic server): the samples the tool measured
        engine = SGLangEngine([server.url], num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS)
        groups = engine.generate(
            prompts, SAMPLES, SamplingParams(max_new_tokens=NEW_TOKENS), seed=0, return_routed_experts=True
        )
    finally:
        server.stop()
    report = json.loads((tmp_path / "out" / "drift.json").read_text())
    flips = report["metrics"]["changed_frac"]["mean"]
    assert report["simulate_with"] == f"rollout.simulate_mismatch.router_flip_frac={flips:.3g}"
    ref = _transformers_reference(model, [s for g in groups for s in g])
    assert report["layers"] == list(range(LAYERS)) and report["routed_tokens"] == ref["tokens"]
    assert report["metrics"]["changed_frac"]["layers"] == pytest.approx(ref["changed_frac"], abs=1e-12)
    assert report["metrics"]["any_layer_changed_frac"]["mean"] == pytest.approx(ref["any_layer"], abs=1e-12)
    assert report["metrics"]["any_layer_changed_frac"]["mean"] > 0, "bf16 weights must change some routing"
    mismatch = report["logp_mismatch"]
    for key in ("logp_mismatch_mean", "logp_mismatch_routing_changed", "logp_mismatch_routing_same"):
        assert mismatch[key] == pytest.approx(ref[key], abs=2e-6), key
    assert mismatch["routing_changed_response_frac"] == pytest.approx(ref["routing_changed_response_frac"])
    disagreement = torch.tensor(report["expert_disagreement"])
    assert disagreement.shape == (LAYERS, EXPERTS) and (disagreement.sum(-1) > 0).tolist() == [
        v > 0 for v in ref["changed_frac"]
    ]
    assert (tmp_path / "out" / "expert_disagreement_heatmap.png").stat().st_size > 0
    assert any((tmp_path / "out" / "tensorboard").iterdir())


def test_the_stand_in_server_simulates_the_local_engines_mismatch(tmp_path: Path) -> None:
    """``--simulate-mismatch``: the SGLang-protocol stand-in routes and samples as the local
    engine's simulation does (here: a fifth of the tokens flipped per layer, and logit noise)."""
    model = save_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", seed=5, num_hidden_layers=LAYERS)
    target = 0.2
    simulated = json.dumps({"router_flip_frac": target, "logit_kl": 2e-3})
    settings = ServerSettings(
        model_path=model,
        port=free_port(),
        return_routed_experts=True,
        deterministic=True,
        launch_command=SERVER,
        extra_args=["--simulate-mismatch", simulated],
    )
    server = SGLangServer(settings, tmp_path / "logs")
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 64) for _ in range(6)] for _ in range(32)]
    try:
        server.wait_healthy(timeout_s=120)
        engine = SGLangEngine([server.url], num_layers=LAYERS, top_k=2, num_experts=4)
        groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=16), seed=0, return_routed_experts=True)
    finally:
        server.stop()
    ref = _transformers_reference(model, [s for g in groups for s in g])
    assert all(abs(f - target) <= 0.4 * target for f in ref["changed_frac"]), ref["changed_frac"]
    assert ref["logp_mismatch_routing_same"] > 1e-3  # the logit part: every token, routed alike or not


def _transformers_reference(model_dir: str, samples) -> dict:
    """Drift of the engine's routing and log-probs against transformers' fp32 model."""
    from transformers import AutoModelForCausalLM

    from moe_rl.routing.hf_routing import transformers_routing

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    engine_routes, ours, changed_tokens, mismatches = [], [], [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.output_ids])
        n, p = ids.shape[1] - 1, len(s.prompt_ids)
        routes, _ = transformers_routing(model, ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        engine_routes.append(s.routed_experts)
        ours.append(routes[0, :n])
        changed = (s.routed_experts.sort(-1).values != routes[0, :n].sort(-1).values).any(-1).any(-1)
        positions = torch.arange(p - 1, p - 1 + len(s.output_ids))  # position t scores token t+1
        ref_logp = logp[positions, torch.tensor(s.output_ids)]
        mismatches.append((ref_logp - torch.tensor(s.output_logprobs)).abs().double())
        changed_tokens.append(changed[positions].double())
    metrics = drift_metrics(torch.cat(engine_routes).long(), torch.cat(ours).long())
    m, c = torch.cat(mismatches), torch.cat(changed_tokens)
    return {
        "tokens": sum(len(r) for r in engine_routes),
        "changed_frac": metrics["changed_frac"].tolist(),
        "any_layer": float(metrics["any_layer_changed_frac"]),
        "logp_mismatch_mean": float(m.mean()),
        "logp_mismatch_routing_changed": float((m * c).sum() / c.sum()) if c.sum() else None,
        "logp_mismatch_routing_same": float((m * (1 - c)).sum() / (1 - c).sum()),
        "routing_changed_response_frac": float(c.mean()),
    }
