"""What moe-rl does on one CUDA GPU, in one run that fits the lent H200 (8 minutes; ``--mode
quick``: 4): writes ``gpu_check.json``. Run it through ``tools/gpu_check/run.sh``, which installs
what the machine lacks first.

Every stage runs in a process of its own under a time limit (the limits add up under the
mode's budget; a stage is cut to what is left of it) and asserts against stated thresholds:
each check is ok, FAILED, or SKIPPED where it cannot run here (no CUDA, no Transformer Engine).

- ``env``: torch / CUDA / GPU, the packages import, the install report has no problem;
- ``prepare`` (full): the built-in model warm-started and cached once for the stages that train it;
- ``kernels``: torch's ``grouped_mm`` against the per-expert loop and an fp32 loop on ragged and
  empty expert groups, forward and backward; attention under activation recompute stays on the
  causal path (no mask tensor; flash-only on CUDA) with the plain run's gradients;
- ``logprob``: the chunked log-prob head's peak memory against full fp32 logits, its fp32-logits
  path, its error and its gradient's against fp64;
- ``parity``: megatron-core against transformers on tiny Qwen3-MoE / DeepSeek-V3 (and GLM-4.5):
  fp32 within 1e-4, bf16 within transformers' own bf16 error;
- ``train``: megatron steps on a fixed batch (bf16): the loss finite and falling, a checkpoint
  resumed in a fresh model equal to the uninterrupted run;
- ``trainer``: ``moe-rl train`` resumed from its step-2 checkpoint equals the straight run at
  step 3; (full) R3 with activation recompute;
- ``offload`` (full): the colocated offload gives the driver the memory back, round trip bit-equal;
- ``colocated`` (full): 2 colocated steps against the SGLang-protocol stand-in (CUDA-IPC sync);
- ``fusions`` (full): Transformer Engine against the local layers, fused AdamW against foreach;
- ``perf`` (full): the bf16 matmul rate and a ~0.7B-parameter MoE's step MFU.

``--scale`` runs the real-shape stages instead (8 minutes): ``env``, then ``slice``,
``long_context``, ``sync`` and ``checkpoint`` on a slice of Qwen3-30B-A3B, and ``peer`` (TRL side by
side on the GPU) (``gpu_check/scale.py``). ``--all`` runs both sets in one command (9 minutes: the
lent machine's 15 minutes hold one start and one such command, with a short second one for
what did not fit); ``--budget`` sets the seconds the stages may take together.

    python -m tools.gpu_check.check [--mode smoke|quick|full] [--scale | --all] [--budget S] [--only a,b]
        [--out-dir DIR] [--in-process]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tools.gpu_check import common as gpu_check_common
from tools.gpu_check.common import FAILED, MODES, ROOT, SKIPPED, Checks, check_line

# stage: (its module, limit in full mode, in quick mode or None when quick leaves it out), in run order
# (the H200's first run, 2026-12-04: the built-in model's warm start took 35-58 s; colocated,
# which then made its own, passed in 84 s: prepare makes it once now, so colocated has 60)
STAGES = {
    "env": ("tools.gpu_check.check", 20, 20),
    "prepare": ("tools.gpu_check.training", 90, None),
    "kernels": ("tools.gpu_check.numerics", 30, 30),
    "logprob": ("tools.gpu_check.numerics", 30, 25),
    "parity": ("tools.gpu_check.numerics", 40, 40),
    "train": ("tools.gpu_check.training", 35, 30),
    "trainer": ("tools.gpu_check.training", 65, 60),
    "offload": ("tools.gpu_check.training", 25, None),
    "colocated": ("tools.gpu_check.training", 60, None),
    "fusions": ("tools.gpu_check.numerics", 25, None),
    "perf": ("tools.gpu_check.training", 30, None),
}
# --scale: the real-shape stages (tools/gpu_check/scale.py), with their limits at full size
SCALE_STAGES = {
    "env": ("tools.gpu_check.check", 20),
    "slice": ("tools.gpu_check.scale", 120),
    "long_context": ("tools.gpu_check.scale", 50),
    "sync": ("tools.gpu_check.scale", 35),
    "checkpoint": ("tools.gpu_check.scale", 80),
    "peer": ("tools.gpu_check.scale", 145),
}
# what the stages may take together; gpu_check.sh's install (30 s at most) and start-up come on
# top: 8 minutes for full, 4 for quick, 8 for --scale. Smoke (CPU, tiny sizes) has no budget.
# --all runs the check's stages, then the scale ones (their env once) in one command, within
# the device's 10 minutes a command: what does not fit is SKIPPED ("no time left"), for a
# second command with --only. --budget replaces the default (what the session has left).
BUDGET_S = {"full": 450, "quick": 205, "smoke": None}
SCALE_BUDGET_S = 450
ALL_BUDGET_S = 540
SMOKE_LIMIT_S = 600
NO_TIME = "no time left"  # why a stage the budget could not fit was SKIPPED
STAGE_SETS = ("check", "scale", "all")


# --all leaves out the check's perf (a 0.7B MoE step's MFU): slice measures the same at real
# shapes, and its 30 s let slice run within the first command's budget
LEFT_OUT_OF_ALL = ("perf",)


def stages_of(mode: str, only: list[str] | None = None, stage_set: str = "check") -> list[str]:
    check = [n for n, (_, _, quick) in STAGES.items() if mode != "quick" or quick is not None]
    both = [n for n in check if n not in LEFT_OUT_OF_ALL] + list(SCALE_STAGES)[1:]
    names = {"check": check, "scale": list(SCALE_STAGES), "all": both}[stage_set]
    return [n for n in names if only is None or n in only]


def limit_of(name: str, mode: str, stage_set: str = "check") -> float:
    if mode == "smoke":
        return SMOKE_LIMIT_S
    if stage_set == "scale" or name not in STAGES:
        return SCALE_STAGES[name][1]
    _, full, quick = STAGES[name]
    return {"full": full, "quick": quick}[mode]


def budget_of(mode: str, stage_set: str = "check") -> float | None:
    if mode == "smoke":
        return None
    return {"check": BUDGET_S[mode], "scale": SCALE_BUDGET_S, "all": ALL_BUDGET_S}[stage_set]


def module_of(name: str) -> str:
    return (STAGES.get(name) or SCALE_STAGES[name])[0]


def stage_env(mode: str, checks: Checks, work: Path, install_report: Path | None = None) -> dict:
    """The machine, and whether what the stages need is there and installed cleanly."""
    import torch

    figures: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(
            gpu=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=list(torch.cuda.get_device_capability()),
        )
        checks.check("CUDA device", True, "==", True)
        checks.check("bf16 supported", torch.cuda.is_bf16_supported(), "==", True)
    elif mode == "smoke":
        checks.skip("CUDA device", "a smoke run on a machine without CUDA")
    else:
        checks.fail("CUDA device", "torch sees no CUDA device")
    for module in ("megatron.core", "transformers", "math_verify", "pybase64"):
        try:
            figures[module] = getattr(__import__(module, fromlist=["__version__"]), "__version__", "?")
            checks.check(f"import {module}", True, "==", True)
        except Exception as e:  # noqa: BLE001 (recorded as the check's reason)
            checks.fail(f"import {module}", f"{type(e).__name__}: {e}")
    try:
        import transformer_engine

        figures["transformer_engine"] = transformer_engine.__version__
    except Exception as e:  # noqa: BLE001 (TE is optional: the fusions stage says SKIPPED)
        figures["transformer_engine"] = f"absent ({type(e).__name__})"
    if install_report is None or not install_report.exists():
        checks.skip("install report", "no install step ran (gpu_check.sh writes it)")
        return figures
    report = json.loads(install_report.read_text())
    figures["install"] = {
        k: report[k] for k in ("install", "installed", "conflicts", "unmet", "missing_wheels", "seconds")
    }
    checks.check("wheels installed / planned", len(report["installed"]), "==", len(report["install"]))
    checks.check(
        "install problems (missing wheels, pip errors)",
        len(report["missing_wheels"]) + (report["pip_exit"] != 0),
        "==",
        0,
    )
    checks.check(
        "preinstalled versions a requirement refuses", len(report["conflicts"]) + len(report["unmet"]), "==", 0
    )
    return figures


def run_stage(
    name: str, mode: str, install_report: Path | None = None, limit: float | None = None, work: Path | None = None
) -> dict:
    """One stage in this process: its verdict, checks and figures (an exception is a FAILED
    check); in ``work`` (a temporary directory when not given)."""
    import importlib

    checks = Checks()
    module = importlib.import_module(module_of(name))
    start = time.perf_counter()
    gpu_check_common.DEADLINE[:] = [] if limit is None else [time.monotonic() + limit]
    with contextlib.ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_")))
        try:
            extra = {"install_report": install_report} if name == "env" else {}
            figures = getattr(module, f"stage_{name}")(mode, checks, work, **extra)
        except Exception as e:  # noqa: BLE001 (the stage's result says what broke)
            checks.fail("stage raised", f"{type(e).__name__}: {e}")
            figures = {"traceback": traceback.format_exc()[-3000:]}
    seconds = round(time.perf_counter() - start, 1)
    return {"verdict": checks.verdict(), "seconds": seconds, "checks": checks.items, "figures": figures}


def run_child(name: str, mode: str, limit: float, install_report: Path | None, logs_to: Path | None = None) -> dict:
    """``name`` in a process (and session) of its own, killed with whatever it started at
    ``limit`` (and at its end: nothing of it outlives the stage). Its output goes to a file,
    printed here after it (no pipe a leftover process could hold open). A stage that fails
    leaves the logs of the commands it ran in ``logs_to`` (a stage killed at its limit too)."""
    work = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))
    try:
        result = _run_child_in(name, mode, limit, install_report, work)
        if result["verdict"] == FAILED and logs_to is not None:
            keep_logs(work, logs_to / name)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def keep_logs(work: Path, to: Path, limit_bytes: int = 200_000) -> None:
    """Each ``*.log`` under ``work`` into ``to`` (its last ``limit_bytes``)."""
    for log in sorted(work.rglob("*.log")):
        target = to / log.relative_to(work)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "rb") as f:
            f.seek(max(0, log.stat().st_size - limit_bytes))
            target.write_bytes(f.read())


def _run_child_in(name: str, mode: str, limit: float, install_report: Path | None, work: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = Path(f.name)
    command = [sys.executable, "-W", "ignore", "-m", "tools.gpu_check.check", "--stage", name, "--mode", mode]
    command += ["--result", str(result_path), "--work", str(work)]
    command += ["--limit", str(limit)] + (["--install-report", str(install_report)] if install_report else [])
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        child = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=output, stderr=output)
        try:
            code = child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        _kill_group(child)
        output.seek(0)
        print(output.read()[-20000:], end="", flush=True)
    try:
        result = json.loads(result_path.read_text()) if code == 0 else None
    except (OSError, json.JSONDecodeError):
        result = None
    finally:
        result_path.unlink(missing_ok=True)
    if result is None:
        why = f"over its {limit:.0f} s limit" if code is None else f"the stage's process exited {code}"
        result = {"verdict": FAILED, "checks": [{"name": "stage finished", "verdict": FAILED, "why": why}]}
        result["timed_out"] = code is None
        print(check_line(result["checks"][0]), flush=True)
    return result | {"seconds": round(time.perf_counter() - start, 1)}


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def strict_json(results: dict) -> str:
    """``results`` as JSON every reader takes: NaN and infinities as the strings "nan",
    "inf", "-inf" (Python's bare NaN is no JSON), anything else unknown as its ``str``."""

    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(results), indent=1, default=str, allow_nan=False)


def _out_of_time(result: dict) -> bool:
    """Whether a stage ended at its limit: killed there, or a command it ran stopped just before."""
    return bool(result.get("timed_out")) or any("TimeoutExpired" in str(c.get("why", "")) for c in result["checks"])


def run_all(args: argparse.Namespace) -> dict:
    budget = args.budget if args.budget is not None else budget_of(args.mode, args.stage_set)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": args.mode, "budget_s": budget}
    results["stage_set"] = args.stage_set
    results |= {"verdicts": {}, "stages": {}, "ok": True}
    out = args.out_dir / "gpu_check.json"
    start = time.perf_counter()
    for name in stages_of(args.mode, args.only, args.stage_set):
        left = None if budget is None else budget - (time.perf_counter() - start)
        full_limit = limit_of(name, args.mode, args.stage_set)
        limit = full_limit if left is None else min(full_limit, left)
        if limit < 5:
            result = {
                "verdict": SKIPPED,
                "seconds": 0.0,
                "checks": [{"name": name, "verdict": SKIPPED, "why": NO_TIME}],
            }
        elif args.in_process:
            print(f"[gpu_check] {name} (in this process)", flush=True)
            result = run_stage(name, args.mode, args.install_report)
        else:
            print(f"[gpu_check] {name} (limit {limit:.0f} s)", flush=True)
            result = run_child(name, args.mode, limit, args.install_report, args.out_dir / "logs")
            if limit < full_limit and _out_of_time(result):  # the budget, not the stage, ran out
                result |= {"verdict": SKIPPED, "checks": [{"name": name, "verdict": SKIPPED, "why": NO_TIME}]}
        result["limit_s"] = round(limit)
        results["stages"][name], results["verdicts"][name] = result, result["verdict"]
        print(f"[gpu_check] {name}: {result['verdict']} in {result['seconds']} s (limit {round(limit)})", flush=True)
        results["ok"] = FAILED not in results["verdicts"].values()
        out.write_text(strict_json(results))  # after every stage: nothing lost on a kill
    results["seconds"] = round(time.perf_counter() - start, 1)
    results["not_run"] = [n for n, r in results["stages"].items() if r["checks"][0].get("why") == NO_TIME]
    out.write_text(strict_json(results))
    print(f"[gpu_check] {'ok' if results['ok'] else 'FAILED'}: {results['verdicts']}; wrote {out}", flush=True)
    if results["not_run"]:
        again = f"--{args.stage_set} " if args.stage_set != "check" else ""
        print(f"[gpu_check] not run, no time left: {again}--only {','.join(results['not_run'])}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES, default="full")
    p.add_argument("--only", type=lambda s: s.split(","), help="comma-separated stages")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "gpu_check")
    p.add_argument("--install-report", type=Path, help="tools/gpu_check/install.py's report")
    p.add_argument("--in-process", action="store_true", help="every stage in this process, no time limits")
    sets = p.add_mutually_exclusive_group()
    sets.add_argument("--scale", dest="stage_set", action="store_const", const="scale", help="the real-shape stages")
    sets.add_argument(
        "--all", dest="stage_set", action="store_const", const="all", help="the check's, then the scale ones"
    )
    p.add_argument("--budget", type=float, help="seconds the stages may take together (default: the mode's)")
    p.add_argument("--stage", choices=sorted(set(STAGES) | set(SCALE_STAGES)), help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.set_defaults(stage_set="check")
    args = p.parse_args(argv)
    if args.stage:
        args.result.write_text(
            json.dumps(run_stage(args.stage, args.mode, args.install_report, args.limit, args.work), default=str)
        )
        return 0
    if args.stage_set == "all" and args.mode == "quick":
        p.error("--all runs the full stages: leave --quick out")
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget must be a positive number of seconds, not {args.budget:g}")
    valid = stages_of(args.mode, None, args.stage_set)
    unknown = set(args.only or []) - set(valid)
    if unknown:
        p.error(
            f"unknown stages {sorted(unknown)}; stages of --mode {args.mode} ({args.stage_set}): {', '.join(valid)}"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = run_all(args)
    return 0 if results["ok"] and not results["not_run"] else 1  # (a stage left out is not green)


if __name__ == "__main__":
    sys.exit(main())
