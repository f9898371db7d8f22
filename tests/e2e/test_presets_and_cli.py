"""Shipped algorithm presets are valid, and the console script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from moe_rl.algorithms import compute_advantages, policy_loss

PRESETS = sorted((Path(__file__).parents[2] / "configs" / "algorithms").glob("*.yaml"))


def test_presets_exist() -> None:
    names = {p.stem for p in PRESETS}
    assert {"grpo", "dapo", "dr_grpo", "gspo", "gspo_token", "gmpo", "gdpo"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_runs_through_the_api(path: Path) -> None:
    cfg = yaml.safe_load(path.read_text())["algorithm"]  # (a config of its own: its algorithm section)
    adv = compute_advantages(cfg["advantage"], torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), 2)
    logp = torch.full((4, 3), -1.0, requires_grad=True)
    loss, metrics = policy_loss(
        cfg["loss"], logp, torch.full((4, 3), -1.1), adv, torch.ones(4, 3), **cfg["loss_params"]
    )
    loss.backward()
    assert torch.isfinite(loss) and logp.grad.abs().sum() > 0 and "clip_frac" in metrics


def test_console_script_help_and_demo_errors(tmp_path) -> None:
    exe = Path(sys.executable).with_name("moe-rl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moe_rl.cli"]
    bare = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2
    for command in ("train", "compare", "demo", "parity", "export", "drift", "prepare", "eval"):
        assert command in bare.stdout
    missing = subprocess.run(
        cmd + ["demo", "--config", str(tmp_path / "none.yaml")], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and "not found" in missing.stderr
