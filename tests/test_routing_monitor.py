"""A training step's routing measurements (RoutingMonitor) for none / r2 / r3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.models.tiny import save_tiny_checkpoint


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    hf_dir = save_tiny_checkpoint(tmp_path_factory.mktemp("mon") / "hf", "qwen3_moe", seed=6)
    script = Path(__file__).with_name("routing_monitor_checks.py")
    out = subprocess.run([sys.executable, "-W", "ignore", str(script), hf_dir], capture_output=True, text=True, timeout=300)
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
