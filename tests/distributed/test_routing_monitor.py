"""A training step's routing measurements (RoutingMonitor) for none / r2 / r3; compact
routing indices; the metrics on a sample of the tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import SUPPORT
from moe_rl.models.tiny import save_tiny_checkpoint


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    hf_dir = save_tiny_checkpoint(tmp_path_factory.mktemp("mon") / "hf", "qwen3_moe", seed=6)
    script = SUPPORT / "routing_monitor_checks.py"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), hf_dir], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    return {r["mode"]: r for r in lines}


def test_replayed_pass_has_zero_routing_change_under_r2_and_r3(results) -> None:
    for mode in ("r2", "r3"):
        assert max(results[mode]["replayed"]["changed_frac"]) == 0.0, mode
        assert results[mode]["replayed"]["any_layer_changed_frac"] == 0.0


def test_an_update_changes_routing_and_it_is_measured(results) -> None:
    for mode in ("none", "r2", "r3"):
        drift = results[mode]["old_vs_new"]
        assert drift["drift_layers"] == [0, 1]
        assert 0 < drift["any_layer_changed_frac"] <= 1 and drift["router_kl"][0] > 0
        assert 0 < drift["expert_change_frac"][0] <= drift["changed_frac"][0]


def test_train_vs_rollout_and_load(results) -> None:
    # the "engine" is transformers on the same fp32 weights: identical routing
    for mode in ("none", "r2", "r3"):
        assert results[mode]["train_vs_rollout"]["changed_frac"] == [0.0, 0.0]
        load = results[mode]["load"]
        # 2 micro-batches x (9 + 6 routed positions) x k=2 choices per layer
        assert [sum(row) for row in load["expert_load"]] == [60.0, 60.0]
        assert len(load["expert_load_cv"]) == 2


def test_a_sample_without_engine_routing_is_left_out_of_train_vs_rollout(results) -> None:
    """Its positions hold replay filler, not routing the engine chose: counted, they made
    ~1/3 of an otherwise identical batch's tokens "changed"."""
    empty = results["empty_response"]
    assert empty["changed_frac"] == [0.0, 0.0] and empty["any_layer_changed_frac"] == 0.0


def test_routing_is_kept_compact_and_router_distributions_only_for_router_kl(results) -> None:
    for mode in ("none", "r2", "r3"):
        kept = results[mode]["kept"]
        assert kept["index_dtypes"] == ["torch.uint8"] and kept["old_probs_kept"] == [True, True]  # 4 experts: 1 byte
        assert kept["replay_dtypes"] == ([] if mode == "none" else ["torch.uint8"])
        assert "router_kl" in results[mode]["old_vs_new"]
    assert (
        results["r3_sampled"]["kept"]["old_probs_kept"] == [False, False]
        and "router_kl" not in results["r3_sampled"]["old_vs_new"]
    )


def test_replay_from_compact_indices_equals_int64_replay(results) -> None:
    check = results["compact_vs_int64"]
    assert check["compact_dtype"] == "torch.uint8" and check["router_grad_min"] > 0
    assert check["logprobs_equal"] and check["losses_equal"] and check["router_grads_equal"]
    assert check["max_diff_to_own_routing"] < 5e-7  # the engine's routing is the model's own here


def test_metrics_on_a_sample_of_tokens_estimate_all_of_them(results) -> None:
    sampled = results["r3_sampled"]
    # a third of each micro-batch's 9 + 6 routed positions is observed ...
    assert sampled["kept"]["observed_tokens"] == [5, 5]
    # ... weighted so that counts estimate all tokens: 2 micro-batches x 15 positions x k=2 per layer
    assert [sum(row) for row in sampled["load"]["expert_load"]] == pytest.approx([60.0, 60.0])
    assert sampled["replayed"]["any_layer_changed_frac"] == 0.0 and sampled["train_vs_rollout"]["changed_frac"] == [
        0.0,
        0.0,
    ]
    assert 0 < sampled["old_vs_new"]["any_layer_changed_frac"] <= 1
