"""tools/gpu_check/run.sh: what it installs on the lent H200 (planned against that machine's package
list), its time budget and its verdicts (the smoke runs of its stages: tests/e2e/test_gpu_check_smoke.py)."""

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

MISSING_ON_H200 = {"megatron-core", "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime", "pybase64"}


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
        ("-cp312-cp312-manylinux" in e["file"] and e["file"].endswith("_x86_64.whl"))
        or e["file"].endswith("-py3-none-any.whl")
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
    assert "would install (pip --no-deps, into a folder of their own): 4 wheels" in out.stdout  # + pybase64
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
    scale = sum(gpu_check.limit_of(n, "full", "scale") for n in gpu_check.stages_of("full", stage_set="scale"))
    assert scale <= gpu_check.SCALE_BUDGET_S and gpu_check.SCALE_BUDGET_S + install_s <= 60 * 8
    assert gpu_check.stages_of("full", stage_set="scale") == [
        "env",
        "slice",
        "long_context",
        "sync",
        "checkpoint",
        "peer",
    ]
    # --all: one command within the device's 10 minutes (install and start-up on top), both
    # sets once each (env once), every stage able to run whole within the budget
    both = gpu_check.stages_of("full", stage_set="all")
    check = [n for n in gpu_check.stages_of("full") if n != "perf"]  # slice measures its MFU at real shapes
    assert both == check + gpu_check.stages_of("full", stage_set="scale")[1:]
    assert gpu_check.ALL_BUDGET_S + install_s <= 60 * 9.5
    # the first command runs the whole check and the slice (the step's MFU and profile)
    assert sum(gpu_check.limit_of(n, "full", "all") for n in both[: both.index("slice") + 1]) <= gpu_check.ALL_BUDGET_S
    assert all(gpu_check.limit_of(n, "full", "all") <= gpu_check.ALL_BUDGET_S for n in both)
    assert [gpu_check.limit_of(n, "full", "all") for n in ("trainer", "slice")] == [65, 120]


def test_stages_past_the_budget_are_named_for_a_second_command(tmp_path: Path, capsys) -> None:
    """--budget below what a stage needs: no stage starts, each is SKIPPED for want of time,
    the run is not green, and its last line is the --only to run them later."""
    code = gpu_check.main(["--all", "--budget", "4", "--out-dir", str(tmp_path), "--only", "trainer,slice"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and result["budget_s"] == 4 and result["not_run"] == ["trainer", "slice"]
    assert set(result["verdicts"].values()) == {SKIPPED}
    assert capsys.readouterr().out.splitlines()[-1].endswith("no time left: --all --only trainer,slice")


def test_a_stage_the_budget_cut_short_is_not_run_and_one_out_of_its_own_time_failed(
    tmp_path: Path, monkeypatch
) -> None:
    """Both stages end at their limits: trainer had its whole 65 s (FAILED), slice only what
    was left of a 100 s budget, less than its 120 (SKIPPED "no time left", for a second call)."""
    limits = {}

    def ends_at_its_limit(name, mode, limit, install_report, logs_to):
        limits[name] = limit
        why = {"name": "stage finished", "verdict": FAILED, "why": f"over its {limit:.0f} s limit"}
        return {"verdict": FAILED, "checks": [why], "timed_out": True, "seconds": 0.0}

    monkeypatch.setattr(gpu_check, "run_child", ends_at_its_limit)
    code = gpu_check.main(["--all", "--budget", "100", "--out-dir", str(tmp_path), "--only", "trainer,slice"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert limits["trainer"] == 65 and 99 < limits["slice"] < 100
    assert code == 1 and result["verdicts"] == {"trainer": FAILED, "slice": SKIPPED} and result["not_run"] == ["slice"]


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


def test_a_failed_stage_keeps_the_tails_of_its_commands_logs(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "run").mkdir(parents=True)
    (work / "prepare.log").write_text("x" * 300_000 + "the end")
    (work / "run" / "train.log").write_text("Traceback: boom")
    (work / "model.safetensors").write_bytes(b"0" * 1000)
    gpu_check.keep_logs(work, out / "trainer")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "trainer/prepare.log",
        "trainer/run/train.log",
    ]
    kept = (out / "trainer" / "prepare.log").read_text()
    assert len(kept) == 200_000 and kept.endswith("the end")


def test_results_are_strict_json_with_nan_as_text() -> None:
    text = gpu_check.strict_json(
        {"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": -float("inf")}, "p": Path("x")}
    )
    assert json.loads(text) == {"a": "nan", "b": [1.5, "inf"], "c": {"d": "-inf"}, "p": "x"}
    assert "NaN" not in text
