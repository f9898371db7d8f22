"""megatron-core backend on CPU: parity with transformers, HF round trip, and every
parallel layout (TP, EP, PP, ETP, PP x EP) against the single-process run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_rl.models.tiny import save_tiny_checkpoint
from parallel.launch import spawn_local

WORKER = str(Path(__file__).with_name("dist_worker.py"))
ALL_LAYOUTS = {
    1: ["1,1,1,1"],
    2: ["2,1,1,2", "2,1,1,1", "1,1,2,1", "1,2,1,1"],  # TP2+SP, TP2/ETP1, EP2, PP2
    4: ["1,2,2,1", "2,1,2,1", "2,1,2,2"],  # PP2 x EP2, TP2 x EP2 with ETP1 and ETP2
}


@pytest.fixture(scope="module")
def qwen3_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3")
    hf_dir = save_tiny_checkpoint(root / "hf", "qwen3_moe", seed=1)
    for nproc, layouts in ALL_LAYOUTS.items():
        code = spawn_local(nproc, ["-W", "ignore", WORKER, hf_dir, str(root / "out"), *layouts], timeout_s=400)
        assert code == 0, f"{nproc}-process worker failed with exit code {code}"
    return root / "out"


def _grads(run: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for file in sorted(run.glob("grads_rank*.pt")):
        part = torch.load(file)
        assert not set(part) & set(merged), "two ranks wrote the same tensor"
        merged.update(part)
    return merged


@pytest.mark.parametrize("layout", [l for n in (2, 4) for l in ALL_LAYOUTS[n]])
def test_layout_matches_single_process(qwen3_runs: Path, layout: str) -> None:
    ref, run = qwen3_runs / "1-1-1-1", qwen3_runs / layout.replace(",", "-")
    torch.testing.assert_close(torch.load(run / "logp.pt"), torch.load(ref / "logp.pt"), rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.load(run / "entropy.pt"), torch.load(ref / "entropy.pt"), rtol=0, atol=2e-5)
    ref_grads, grads = _grads(ref), _grads(run)
    assert set(grads) == set(ref_grads)
    for key, g in ref_grads.items():
        torch.testing.assert_close(grads[key], g, rtol=1e-4, atol=2e-6, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(torch.load(run / "losses.pt"), torch.load(ref / "losses.pt"), rtol=1e-4, atol=1e-5)


def test_loss_goes_down_over_optimizer_steps(qwen3_runs: Path) -> None:
    for layout in ("1-1-1-1", "1-1-2-1", "1-2-1-1", "1-2-2-1"):
        losses = torch.load(qwen3_runs / layout / "losses.pt")
        assert (losses[1:] < losses[:-1]).all(), f"{layout}: {losses.tolist()}"
