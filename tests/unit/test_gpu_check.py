"""tools/gpu_check/run.sh: what it installs on the lent H200 (planned against that machine's package
list), its time budget, its verdicts, and a smoke run of its stages on this machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.gpu_check import check as gpu_check
from tools.gpu_check import install
from tools.gpu_check.common import FAILED, OK, SKIPPED, Checks
from tools.gpu_check.training import resume_differences

ROOT = Path(__file__).resolve().parents[2]

MISSING_ON_H200 = {"megatron-core", "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime"}


def lock() -> dict:
    return json.loads(install.LOCK.read_text())


def test_the_h200_gets_only_what_it_lacks_and_keeps_every_preinstalled_package() -> None:
    machine = install.read_package_list(install.H200_PACKAGES)
    assert machine["torch"] == "2.11.0" and machine["transformers"] == "5.17.0" and "megatron-core" not in machine
    plan = install.make_plan(machine, lock())
    installed = {install.normalize(e["name"]) for e in plan.install}
    assert installed == MISSING_ON_H200 and not installed & set(machine)
    assert plan.conflicts == [] and plan.unmet == []
    assert {"torch", "transformers", "numpy", "packaging", "sympy"} <= set(plan.present)  # kept as they are
    for req in install.project_requirements():  # each of moe-rl's dependencies is accounted for
        name = install.normalize(req.name)
        assert name in machine or name in installed or name in install.LEFT_OUT, name
    assert all(
        e["file"].endswith(("-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", "-py3-none-any.whl"))
        for e in plan.install
    )


def test_a_refused_preinstalled_version_is_reported_not_replaced() -> None:
    machine = install.read_package_list(install.H200_PACKAGES) | {"torch": "2.5.1", "packaging": "23.0"}
    del machine["sympy"]
    plan = install.make_plan(machine, lock())
    assert {install.normalize(e["name"]) for e in plan.install} == MISSING_ON_H200  # torch is not among them
    assert any("megatron-core needs torch>=2.6.0, the machine has 2.5.1" in c for c in plan.conflicts)
    assert any("moe-rl needs torch>=2.6" in c for c in plan.conflicts)
    assert any("packaging>=24.2, the machine has 23.0" in c for c in plan.conflicts)
    assert plan.unmet == [
        "latex2sympy2_extended needs sympy: neither on the machine nor in tools/gpu_check/wheels.json"
    ]


def test_dry_run_prints_the_plan_for_a_package_list(tmp_path: Path) -> None:
    listed = tmp_path / "machine.txt"
    listed.write_text("# pip list\nPackage Version\ntorch 2.11.0\nnumpy==2.5.2\ntransformers\nmegatron_core 0.16.1\n")
    out = subprocess.run(
        ["bash", "tools/gpu_check/run.sh", "--dry-run", "--packages", str(listed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stderr
    assert "would install (pip --no-deps, into a folder of their own): 3 wheels" in out.stdout
    assert "math_verify-0.9.0-py3-none-any.whl" in out.stdout and "megatron_core-0.16.1-cp312" not in out.stdout
    assert "torch 2.11.0" in out.stdout and "left out: deepspeed" in out.stdout


def test_what_travels_fits_and_the_stage_limits_fit_the_device() -> None:
    wheels = sum(e["bytes"] for e in lock()["packages"])
    assert (wheels + install.tree_bytes()) / 2**20 <= install.SIZE_LIMIT_MIB
    install_s = 30  # gpu_check.sh's timeout on the install step
    for mode, minutes in (("full", 8), ("quick", 4)):
        limits = sum(gpu_check.limit_of(n, mode) for n in gpu_check.stages_of(mode))
        assert limits <= gpu_check.BUDGET_S[mode] and gpu_check.BUDGET_S[mode] + install_s <= 60 * minutes, mode
    assert gpu_check.stages_of("quick") == ["env", "kernels", "logprob", "parity", "train", "trainer"]
    scale = sum(gpu_check.limit_of(n, "full", scale=True) for n in gpu_check.stages_of("full", scale=True))
    assert scale <= gpu_check.SCALE_BUDGET_S and gpu_check.SCALE_BUDGET_S + install_s <= 60 * 8
    assert gpu_check.stages_of("full", scale=True) == ["env", "slice", "long_context", "sync", "checkpoint", "peer"]


def test_checks_fail_on_nan_and_a_stage_of_skips_says_skipped() -> None:
    checks = Checks()
    checks.skip("te", "absent")
    assert checks.verdict() == SKIPPED
    assert checks.check("err", 1e-5, "<=", 1e-4) and checks.verdict() == OK
    assert not checks.check("loss", math.nan, "<=", 1.0) and checks.verdict() == FAILED
    assert Checks().verdict() == FAILED  # a stage that asserted nothing


def test_resume_differences_are_relative_and_a_missing_step_is_infinite() -> None:
    straight = {3: {"train/loss": 2.0, "train/grad_norm": 1.0, "reward/total": 0.5}}
    resumed = {3: {"train/loss": 2.002, "train/grad_norm": 1.0, "reward/total": 0.5}}
    assert resume_differences(straight, resumed, [3]) == pytest.approx(
        {"train/loss": 1e-3, "train/grad_norm": 0.0, "reward/total": 0.0}
    )
    assert resume_differences(straight, {}, [3])["train/loss"] == math.inf


@pytest.mark.e2e
def test_smoke_run_of_the_stages(tmp_path: Path) -> None:
    """``gpu_check.sh --smoke`` (its stages in one process; the trainer's own runs are the e2e
    lane's): every stage passes or, for what needs CUDA, says SKIPPED."""
    import torch

    stages = "env,kernels,logprob,parity,train,offload,fusions,perf"
    out = subprocess.run(
        ["bash", "tools/gpu_check/run.sh", "--smoke", "--in-process", "--only", stages],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore"},
    )
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out.returncode == 0, out.stdout[-3000:]
    assert result["mode"] == "smoke" and list(result["verdicts"]) == stages.split(",")
    assert set(result["verdicts"].values()) == {OK}
    assert "[gpu_check] kernels: ok" in (tmp_path / "gpu_check.log").read_text()
    verdicts = {c["name"]: c["verdict"] for s in result["stages"].values() for c in s["checks"]}
    for name in (
        "grouped_mm forward vs fp32 loop (ragged + empty groups)",
        "grouped_mm weight grad of empty experts",
        "attention calls with a mask tensor (plain + recompute)",
        "log-prob error / bf16 logits' error",
        "qwen3_moe bf16 mean |logp - transformers fp32|",
        "last loss / first loss (fixed batch)",
        "resumed weights: max |diff| / their change over the resumed steps",
        "weights and optimizer state after the round trip equal",
        "megatron Adam fused vs foreach: weights after 3 steps (abs)",
        "wheels installed / planned",
    ):
        assert verdicts[name] == OK, name
    if not torch.cuda.is_available():
        for name in (
            "CUDA device",
            "recomputed layers run with only the flash kernel allowed",
            "chunked head's peak memory / full fp32 logits'",
            "device memory the driver got back / freed",
            "transformer_engine vs local",
        ):
            assert verdicts[name] == SKIPPED, name


@pytest.mark.e2e
def test_smoke_run_of_the_scale_stages(tmp_path: Path) -> None:
    """``gpu_check.sh --smoke --scale`` (tiny sizes, in one process): the dispatchers give the
    same log-probs, the replayed long sequence its own, every packed tensor the export's, both
    checkpoints are written; rates and syncs say SKIPPED off a GPU."""
    import torch

    out = subprocess.run(
        ["bash", "tools/gpu_check/run.sh", "--smoke", "--scale", "--in-process"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore"},
    )
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out.returncode == 0, out.stdout[-3000:]
    assert result["stage_set"] == "scale" and list(result["verdicts"]) == gpu_check.stages_of("full", scale=True)
    assert set(result["verdicts"].values()) == {OK}
    figures = {name: stage["figures"] for name, stage in result["stages"].items()}
    assert figures["slice"]["one_rank_vs_allgather_max_logp_diff"] == 0.0
    assert figures["slice"]["alltoall_vs_allgather_max_logp_diff"] == 0.0
    assert all(math.isfinite(figures["slice"][k]["forward_backward_s"]) for k in ("one_rank", "allgather", "alltoall"))
    assert figures["long_context"]["max_logp_diff_replayed_vs_own"] == 0.0
    assert figures["long_context"]["routing_bytes"] == 512 * 2 * 2  # tokens x MoE layers x top-k, a byte each
    assert figures["sync"]["bytes"] > 0 and figures["sync"]["buckets"] >= 1
    assert {"fully_reshardable", "dp_reshardable"} <= set(figures["checkpoint"])
    if not torch.cuda.is_available():
        verdicts = {c["name"]: c["verdict"] for s in result["stages"].values() for c in s["checks"]}
        assert verdicts["one_rank: forward+backward MFU vs the measured matmul rate"] == SKIPPED
