"""A/B runs for changes that must not change behaviour: the same short training runs from two
checkouts, then their ``metrics.jsonl``, ``samples.jsonl`` and TensorBoard tags compared.

    python -m tools.dev.ab_runs run --out /tmp/ab/before [--src CHECKOUT] [--only default,gdpo]
    python -m tools.dev.ab_runs run --out /tmp/ab/after
    python -m tools.dev.ab_runs compare /tmp/ab/before /tmp/ab/after    # exit 1 on any difference

``--src`` is the checkout whose ``moe_rl`` runs (default: this one), with this venv's Python.
What may differ between two runs of one tree is left out: ``perf/*`` times, rates and memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name -> moe-rl train arguments (short runs covering the step's paths)
SCENARIOS: dict[str, list[str]] = {
    "default": ["train.steps=3"],
    "r3_mismatch": [
        "train.steps=3",
        "routing.replay=r3",
        "rollout.precision=bf16",
        "rollout.simulate_mismatch.routing_kl=7.85e-4",
        "rollout.simulate_mismatch.logit_kl=7.5e-4",
    ],
    "multi_turn_failures": [
        "train.steps=2",
        "rollout.generate_fn=multi_turn_fns:fails_by_seed",
        "rollout.max_failed_frac=0.9",
        "rollout.failed_samples=drop",
    ],
    "calculator_r3": ["--config", "configs/multi_turn/calculator.yaml", "train.steps=2"],
    "gdpo": ["train.steps=3", "algorithm.advantage=gdpo"],
}
# figures that differ between two runs of one tree
VOLATILE = (
    "perf/step_time_s",
    "perf/rollout_time_s",
    "perf/train_time_s",
    "perf/tokens_per_s",
    "perf/peak_memory_mb",
    "rollout/multi_turn/environment_seconds_mean",
)


def run(out: Path, src: Path, only: list[str]) -> int:
    """Every scenario (or ``only``) from checkout ``src`` into ``out/<name>``."""
    env = {**os.environ, "PYTHONPATH": f"{src}:{src / 'tests' / 'support'}", "PYTHONWARNINGS": "ignore"}
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in only or list(SCENARIOS):
        run_dir = out / name
        start = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            done = subprocess.run(
                [sys.executable, "-W", "ignore", "-m", "moe_rl.cli", "train", *SCENARIOS[name]]
                + ["train.progress=false", f"train.run_dir={run_dir}"],
                cwd=src,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        print(f"{name}: exit {done.returncode} in {time.monotonic() - start:.0f} s ({out / name}.log)", flush=True)
        failed += done.returncode != 0
    return 1 if failed else 0


def _metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in VOLATILE} for row in rows]


def _tensorboard(run_dir: Path) -> dict[str, object]:
    """Every tag by kind, with scalar values (volatile ones' tags only)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    out: dict[str, object] = {kind: sorted(v) for kind, v in tags.items() if isinstance(v, list)}
    out["scalar_values"] = {
        t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"] if t not in VOLATILE
    }
    return out


def compare(a: Path, b: Path) -> int:
    """Differences between two ``run`` outputs, printed; 1 if any."""
    names = sorted(p.name for p in a.iterdir() if p.is_dir())
    problems = 0
    for name in names:
        diffs = []
        if _metrics(a / name / "metrics.jsonl") != _metrics(b / name / "metrics.jsonl"):
            ma, mb = _metrics(a / name / "metrics.jsonl"), _metrics(b / name / "metrics.jsonl")
            keys = sorted({k for r in ma + mb for k in r if any(x.get(k) != y.get(k) for x, y in zip(ma, mb))})
            diffs.append(f"metrics.jsonl differs ({len(ma)} vs {len(mb)} rows; keys: {keys[:8]})")
        if (a / name / "samples.jsonl").read_text() != (b / name / "samples.jsonl").read_text():
            diffs.append("samples.jsonl differs")
        ta, tb = _tensorboard(a / name), _tensorboard(b / name)
        for kind in sorted(set(ta) | set(tb)):
            if ta.get(kind) != tb.get(kind):
                diffs.append(f"TensorBoard {kind} differ")
        print(f"{name}: " + ("identical" if not diffs else "; ".join(diffs)))
        problems += bool(diffs)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--src", type=Path, default=ROOT)
    r.add_argument("--only", default="", help="comma-separated scenario names: " + ", ".join(SCENARIOS))
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.out.resolve(), args.src.resolve(), [n for n in args.only.split(",") if n])
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
