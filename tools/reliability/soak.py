"""A long run that should stay flat: what grows between an early step and the last.

    .venv/bin/python -m tools.reliability.soak [--steps 500] [--from-step 50] [--json FILE] [key=value ...]

Runs ``moe-rl train`` in this process on the built-in model (small steps: 4 prompts x 4
samples of at most 8 tokens, so 500 take minutes on 2 cores; a checkpoint every
``--save-every`` steps so the background writers, their commits and the pruning run all
along; the held-out evaluation every 50) and reads this process after each step
(a wrapper put around the trainer's ``train_step`` from outside): resident memory,
Python threads, native threads, open file descriptors and child processes. Prints their
values at ``--from-step`` and at the last step, the growth between, and the resident
memory's slope over the second half (MiB per 100 steps); ``--json`` writes every step's
readings. Exit 1 when threads, descriptors or children grew.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

COUNTED = ("threads", "native_threads", "open_fds", "children")  # what must not grow


def readings() -> dict[str, float]:
    """This process now: resident MiB, Python and native threads, open descriptors, children."""
    status = Path("/proc/self/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    tasks = os.listdir("/proc/self/task")
    children = set()
    for task in tasks:
        with open(f"/proc/self/task/{task}/children") as f:
            children.update(f.read().split())
    return {
        "rss_mib": rss_kb / 1024,
        "threads": threading.active_count(),
        "native_threads": len(tasks),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "children": len(children),
    }


SMALL_STEPS = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8"]


def soak(steps: int, overrides: list[str], save_every: int = 25) -> list[dict[str, float]]:
    """``moe-rl train`` for ``steps`` steps in this process; the readings after each step."""
    from moe_rl.cli import main
    from moe_rl.trainer.trainer import Trainer

    taken: list[dict[str, float]] = []
    train_step = Trainer.train_step

    def reading_after(trainer: Trainer, step: int) -> dict:
        scalars = train_step(trainer, step)
        taken.append({"step": step + 1, **readings()})
        return scalars

    Trainer.train_step = reading_after
    run_dir = tempfile.mkdtemp(prefix="soak_")
    settings = [f"train.run_dir={run_dir}", f"train.steps={steps}", "train.progress=false", *SMALL_STEPS]
    settings += [f"train.save_every={save_every}", "train.keep_last=2", "train.eval_every=50"]
    try:
        code = main(["train", *settings, *overrides])
    finally:
        Trainer.train_step = train_step
    if code != 0:
        raise SystemExit(f"the run failed (exit {code})")
    return taken


def ends(taken: list[dict[str, float]], from_step: int, window: int) -> tuple[dict, dict]:
    """Each reading at the start (the ``window`` steps from ``from_step``) and at the end (the
    last ``window``): its least value there (a checkpoint writer alive at one reading and not
    at another is one child and its descriptors, not growth; a window spans a checkpoint's cycle)."""
    start = [r for r in taken if from_step <= r["step"] < from_step + window]
    end = taken[-window:]
    return ({k: min(r[k] for r in start) for k in start[0]}, {k: min(r[k] for r in end) for k in end[0]})


def growth(taken: list[dict[str, float]], from_step: int, window: int = 1) -> dict[str, float]:
    """Each reading's change from the start to the end (:func:`ends`), and the resident
    memory's least-squares slope over the second half, MiB per 100 steps."""
    first, last = ends(taken, from_step, window)
    out = {key: last[key] - first[key] for key in ("rss_mib", *COUNTED)}
    half = [r for r in taken if r["step"] >= taken[-1]["step"] / 2]
    xs, ys = [r["step"] for r in half], [r["rss_mib"] for r in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    out["rss_mib_per_100_steps"] = 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--from-step", type=int, default=50, help="the early step growth is measured from")
    p.add_argument("--save-every", type=int, default=25, help="steps between checkpoints")
    p.add_argument("--json", type=Path, help="write every step's readings and the growth here")
    p.add_argument("overrides", nargs="*", help="more moe-rl train settings (key=value)")
    args = p.parse_args()
    if not 1 <= args.from_step < args.steps:
        p.error(f"--from-step must be in [1, --steps): got {args.from_step} with --steps {args.steps}")
    if args.steps - args.from_step < 2 * args.save_every:
        p.error("--steps must leave two --save-every windows after --from-step")
    taken = soak(args.steps, args.overrides, args.save_every)
    grew = growth(taken, args.from_step, args.save_every)
    first, last = ends(taken, args.from_step, args.save_every)
    start = f"steps {args.from_step}-{args.from_step + args.save_every - 1}"
    end = f"steps {args.steps - args.save_every + 1}-{args.steps}"
    print(f"least value over {args.save_every} steps (a checkpoint's cycle):")
    print(f"{'':<16}{start:>16}{end:>16}{'growth':>10}")
    for key in ("rss_mib", *COUNTED):
        print(f"{key:<16}{first[key]:>16.1f}{last[key]:>16.1f}{grew[key]:>+10.1f}")
    print(f"resident memory over the second half: {grew['rss_mib_per_100_steps']:+.2f} MiB per 100 steps")
    if args.json:
        args.json.write_text(json.dumps({"growth": grew, "readings": taken}, indent=1))
    leaked = [key for key in COUNTED if grew[key] > 0]
    if leaked:
        print(f"grew: {', '.join(leaked)}")
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
