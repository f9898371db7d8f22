"""Asynchronous rollouts vs synchronous: step time and reward per step on the demo.

    .venv/bin/python -m tools.bench.async_rollouts [--steps 20] [--seeds 1,2] [--json FILE]

Runs `moe-rl train` on the built-in task and model (the README's first command) with
`rollout.async_rollouts=false` and `=true` (both with `algorithm.old_logprobs=rollout`, so
the only difference is the overlap), per seed in the order sync, async, async, sync...
so machine drift hits both alike. Reports the median step time over steps 2.. (the
first async step cannot overlap), the mean training reward per step, and the last 5
steps' reward, per mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(mode: str, seed: int, steps: int, out: Path) -> list[dict]:
    run_dir = out / f"{mode}-{seed}"
    overrides = [
        f"train.steps={steps}",
        f"train.seed={seed}",
        f"train.run_dir={run_dir}",
        "train.progress=false",
        "algorithm.old_logprobs=rollout",
        f"rollout.async_rollouts={'true' if mode == 'async' else 'false'}",
    ]
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "moe_rl.cli", "train", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} seed {seed} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[list[dict]]) -> dict:
    step_times = [r["perf/step_time_s"] for runs in rows for r in runs[1:]]
    rewards = [statistics.mean(r["reward/total"] for r in runs) for runs in rows]
    last = [statistics.mean(r["reward/total"] for r in runs[-5:]) for runs in rows]
    return {
        "median_step_s": statistics.median(step_times),
        "reward_per_step": statistics.mean(rewards),
        "last5_reward": statistics.mean(last),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--json")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp())
    results: dict[str, list] = {"sync": [], "async": []}
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
            results[mode].append(run(mode, seed, args.steps, out))
            print(f"{mode:5s} seed {seed}: done", flush=True)
    table = {mode: summary(rows) for mode, rows in results.items()}
    for mode, row in table.items():
        print(
            f"{mode:5s}: median step {row['median_step_s']:.3f} s, reward per step {row['reward_per_step']:.3f}, "
            f"last 5 steps {row['last5_reward']:.3f}"
        )
    print(f"async / sync step time: {table['async']['median_step_s'] / table['sync']['median_step_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
