"""kill -9 a training run at random moments, again and again, restart it each time, and
check that it ends exactly where an uninterrupted run ends: every weight bit for bit,
every logged step once and equal, nothing left behind but what a restart removes.

    .venv/bin/python -m tools.reliability.kill_resume [--kills 8] [--steps 24] [--engine local|sglang]

With ``--engine sglang`` the runs get their rollouts from the SGLang-protocol test server
(tests/support/sglang_test_server.py) through the disk weight sync, so kills also land in weight
syncs. Each restart is killed after it logs a new step, at a moment the kill's target
picks, cycling through ``--targets``: ``random`` (within the next two steps, step time
measured on the uninterrupted run), ``checkpoint`` (as soon as a checkpoint is being
written) and ``sync`` (as soon as weights are being exported for the engine; sglang
only). Kills stop when the run is complete.
Prints one line per kill (when, what the run was doing, where it resumed) and a verdict;
exit code 0 only when the final weights and logs equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "warm_start.steps=20",
    "warm_start.batch_size=16",
    "train.progress=false",
    "algorithm.micro_batch_size=8",
    "train.save_every=1",
]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def moe_rl(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moe_rl.cli", *args], env=ENV, cwd=ROOT, **kwargs)


def finish(*args: str) -> str:
    """Run to the end; its stderr (raises on failure)."""
    proc = moe_rl(*args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{err[-3000:]}")
    return err


def phase(run_dir: Path) -> str:
    """What a killed run was doing, from the files it left."""
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(p.name.startswith(".tmp_step_") for p in checkpoints.iterdir()):
        return "checkpoint write"
    weights = run_dir / "weights"
    if weights.is_dir() and any(p.name != "current" for p in weights.iterdir()):
        return "weight sync"
    return "rollout / update"


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def kill_once(
    args: list[str], run_dir: Path, rng: random.Random, window_s: float, target: str
) -> tuple[float, str, int]:
    """Start the run, wait for a new logged step, kill -9 at the ``target`` moment (random:
    within the next ``window_s``); (seconds since start, what it was doing, steps logged)."""
    before = len(logged_steps(run_dir))
    start = time.monotonic()
    proc = moe_rl(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while len(logged_steps(run_dir)) <= before and proc.poll() is None and time.monotonic() - start < 300:
        time.sleep(0.05)
    if proc.poll() is not None:
        if proc.returncode != 0:
            raise SystemExit(f"a restart failed by itself (exit code {proc.returncode}) before logging a step")
        return time.monotonic() - start, "(ran to the end)", len(logged_steps(run_dir))
    if target == "random":
        time.sleep(rng.uniform(0, window_s))
    else:
        wanted = {"checkpoint": "checkpoint write", "sync": "weight sync"}[target]
        while phase(run_dir) != wanted and proc.poll() is None:
            time.sleep(0.001)
    when, doing = time.monotonic() - start, phase(run_dir)
    proc.kill()
    proc.wait()
    return when, doing, len(logged_steps(run_dir))


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two runs' final weights and logs (empty: identical)."""
    from moe_rl.models.hf_weights import SafetensorsDir
    from moe_rl.checkpoint.catalog import latest_checkpoint

    (step_a, ckpt_a), (step_b, ckpt_b) = latest_checkpoint(a), latest_checkpoint(b)
    problems = [] if step_a == step_b else [f"final steps differ: {step_a} vs {step_b}"]
    wa, wb = SafetensorsDir(ckpt_a / "model"), SafetensorsDir(ckpt_b / "model")
    if set(wa.keys()) != set(wb.keys()):
        problems.append("the checkpoints hold different tensors")
    problems += [
        f"weights differ: {k}" for k in sorted(set(wa.keys()) & set(wb.keys())) if not wa.get(k).equal(wb.get(k))
    ]
    rows_a = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    if [r["step"] for r in rows_b] != [r["step"] for r in rows_a]:
        problems.append(f"logged steps differ: {[r['step'] for r in rows_b]}")
    skip = ("perf/",)  # timings differ from run to run
    for ra, rb in zip(rows_a, rows_b):
        problems += [
            f"step {ra['step']} {k}: {ra[k]} vs {rb.get(k)}"
            for k in ra
            if not k.startswith(skip) and ra[k] != rb.get(k)
        ]
    leftovers = [p.name for p in (b / "checkpoints").iterdir() if p.name.startswith(".")]
    return problems + ([f"left behind: {leftovers}"] if leftovers else [])


def start_server(model_dir: str, log_dir: Path):
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
    from parallel.launch import free_port

    command = [sys.executable, "-W", "ignore", str(ROOT / "tests" / "support" / "sglang_test_server.py")]
    settings = ServerSettings(
        model_path=model_dir, port=free_port(), return_routed_experts=True, deterministic=True, launch_command=command
    )
    server = SGLangServer(settings, log_dir)
    server.wait_healthy(timeout_s=120)
    return server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--engine", choices=("local", "sglang"), default="local")
    p.add_argument("--targets", default="random,checkpoint,sync", help="kill moments to cycle through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="moe-rl-soak-"))
    common = [*TINY, f"warm_start.cache_dir={out / 'cache'}", f"train.steps={args.steps}", "train.keep_last=2"]
    finish("prepare", *common)
    server = None
    if args.engine == "sglang":
        from moe_rl.config import load_config
        from moe_rl.models.demo_model import demo_model_dir

        server = start_server(str(demo_model_dir(load_config(None, common).demo_model())), out / "logs")
        common += ["rollout.engine=sglang", f"rollout.server.urls=[{server.url}]", "rollout.weight_sync.method=disk"]
    try:
        finish("train", *common, f"train.run_dir={out / 'straight'}")
        step_times = [
            json.loads(line)["perf/step_time_s"]
            for line in (out / "straight" / "metrics.jsonl").read_text().splitlines()
        ]
        window = 2 * sorted(step_times)[len(step_times) // 2]
        rng, chaos = random.Random(args.seed), out / "chaos"
        print(
            f"median step {window / 2:.2f} s; kills within {window:.2f} s of a logged step\n{'kill':>4} {'at s':>6}  {'doing':<17} steps logged"
        )
        for i in range(args.kills):
            if len(logged_steps(chaos)) >= args.steps:
                break
            targets = [t for t in args.targets.split(",") if t != "sync" or args.engine == "sglang"]
            when, doing, steps = kill_once(
                ["train", *common, f"train.run_dir={chaos}"], chaos, rng, window, targets[i % len(targets)]
            )
            print(f"{i + 1:>4} {when:>6.1f}  {doing:<17} {steps}", flush=True)
        finish("train", *common, f"train.run_dir={chaos}")
    finally:
        if server is not None:
            server.stop()
    problems = compare(out / "straight", chaos)
    print(
        "\n".join(problems[:20])
        if problems
        else f"OK: after {args.kills} kills the final weights and {args.steps} logged steps equal the uninterrupted run's"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
