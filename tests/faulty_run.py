"""``moe-rl`` with faults injected through the trainer's seams, for the reliability tests:

    python tests/faulty_run.py [--nan-steps 2,4] [--checkpoint-delay-s 60] -- train ARGS...

``--nan-steps``: those steps' (1-based) losses are NaN, so their updates must be skipped.
``--checkpoint-delay-s``: every checkpoint waits that long, complete but not yet
committed (no ``meta.json``, not renamed), so a test can kill the run mid-checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time

from moe_rl.cli import main
from moe_rl.checkpoint import store as checkpoint
from moe_rl.trainer.trainer import Trainer


def inject_nan_losses(steps: set[int]) -> None:
    original = Trainer.objective_for

    def objective_for(self, batch, counts):
        objective = original(self, batch, counts)
        if batch.step + 1 not in steps:
            return objective

        def nan_loss(logp_entropy, mb):
            loss, metrics = objective(logp_entropy, mb)
            loss = loss * float("nan")
            return loss, {**metrics, "loss": loss.detach()}

        return nan_loss

    Trainer.objective_for = objective_for


def delay_checkpoint_commits(seconds: float) -> None:
    original = checkpoint.commit_checkpoint

    def commit_checkpoint(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    checkpoint.commit_checkpoint = commit_checkpoint


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nan-steps", default="")
    parser.add_argument("--checkpoint-delay-s", type=float, default=0.0)
    args, rest = parser.parse_known_args()
    if args.nan_steps:
        inject_nan_losses({int(x) for x in args.nan_steps.split(",")})
    if args.checkpoint_delay_s:
        delay_checkpoint_commits(args.checkpoint_delay_s)
    sys.exit(main([a for a in rest if a != "--"]))
