"""``moe-rl`` with faults injected through the trainer's seams, for the reliability tests:

    python tests/support/faulty_run.py [--nan-steps 2,4] [--checkpoint-delay-s 60] [--writer-delay-s 5]
        [--pretend-transformer-engine] -- train ARGS...

``--nan-steps``: those steps' (1-based) losses are NaN, so their updates must be skipped.
``--checkpoint-delay-s``: every checkpoint waits that long, complete but not yet
committed (no ``meta.json``, not renamed), so a test can kill the run mid-checkpoint.
``--writer-delay-s``: every rank's forked checkpoint writer waits that long before it
writes (``writer.sleeping`` in the temporary checkpoint says it does), so a test can
kill the run while its writers are still at work.
``--full-disk-at-log-step N``: the write of step N's row to ``metrics.jsonl`` fails as
on a full disk (``ENOSPC``), as does every write of the run after it.
``--full-disk-at-save-step N``: the checkpoint writers of step N's save and later fail
with ``ENOSPC`` (a full disk under the checkpoint).
``--kill-in-partial-rollout-of-step N``: the run SIGKILLs itself once step N's partial
rollout has continued its carried responses by some tokens (``rollout.partial``).
``--crash-after-rollout-of-step N``: step N's rollout lasts until the checkpoint writers of
an earlier save are done (a long rollout), then its update raises.
``--rollout-error-at-step N``: the first rank's rollout of step N fails (``RolloutError``,
as when the servers stay unreachable), while the other ranks wait for its samples.
``--pretend-transformer-engine``: the model saves and asks for what Transformer Engine's
layers hold besides the local ones (an ``_extra_state`` entry per core attention), and
checkpoints record ``transformer_impl=transformer_engine``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

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


def delay_checkpoint_writers(seconds: float) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.write_preloaded_data_multiproc

    def write_preloaded_data_multiproc(*args, **kwargs):
        (Path(args[3][0][0]).parent.parent / "writer.sleeping").touch()  # (in the temporary checkpoint)
        time.sleep(seconds)
        return original(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_preloaded_data_multiproc)


def _no_space() -> OSError:
    import errno

    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write to an open file: no file named


def fill_disk_at_log_step(step: int) -> None:
    from moe_rl.trainer import metrics

    original, full = metrics._append, []

    def append(log, text):
        if log.name.endswith("metrics.jsonl") and text.startswith(f'{{"step": {step},'):
            full.append(True)
        if full:
            raise metrics.with_path(_no_space(), log.name)
        return original(log, text)

    metrics._append = append


def fill_disk_at_save_step(step: int) -> None:
    import functools
    import re

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._write_item

    @functools.wraps(original)
    def write_item(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "write"))  # the open .distcp file
        saving = re.search(r"\.tmp_step_(\d+)\.", str(getattr(stream, "name", "")))
        if saving and int(saving.group(1)) >= step:
            raise _no_space()
        return original(*args, **kwargs)

    filesystem_async._write_item = write_item


def pretend_transformer_engine() -> None:
    import dataclasses

    original = checkpoint.TrainingState.sharded_state_dict

    def sharded_state_dict(self, loading):
        state = original(self, loading)
        model = state["model"]
        for key in [k for k in model if k.endswith("self_attention.linear_proj._extra_state")]:
            extra = key.replace("linear_proj", "core_attention")
            model[extra] = dataclasses.replace(model[key], key=model[key].key.replace("linear_proj", "core_attention"))
        return state

    checkpoint.TrainingState.sharded_state_dict = sharded_state_dict
    checkpoint.transformer_impl_of = lambda model: "transformer_engine"


def kill_in_partial_rollout(step: int) -> None:
    from moe_rl.rollout.partial import PartialRollout

    original = PartialRollout.sample

    def sample(self, *args, **kwargs):
        if kwargs["step"] + 1 == step:  # the engine works on step N's carry: let it generate, then die
            self.engine.generate_requests = _dying(self.engine.generate_requests)
        return original(self, *args, **kwargs)

    PartialRollout.sample = sample


def _dying(generate):
    def generate_then_die(*args, **kwargs):
        generate(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    return generate_then_die


def crash_after_rollout(step: int) -> None:
    collect, update = Trainer.collect_experience, Trainer.update_policy

    def collect_experience(self, s):
        out = collect(self, s)
        while s + 1 == step and self.checkpointer.writing():
            time.sleep(0.05)
        return out

    def update_policy(self, batch, counts):
        if batch.step + 1 == step:
            raise RuntimeError(f"injected crash in step {step}'s update")
        return update(self, batch, counts)

    Trainer.collect_experience, Trainer.update_policy = collect_experience, update_policy


def rollout_error_at(step: int) -> None:
    from moe_rl.experience.collector import ExperienceCollector
    from moe_rl.rollout.types import RolloutError

    collect = ExperienceCollector.collect

    def failing_collect(self, s):
        if s + 1 == step:
            raise RolloutError(f"injected: every server unreachable in step {step}")
        return collect(self, s)

    ExperienceCollector.collect = failing_collect


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nan-steps", default="")
    parser.add_argument("--checkpoint-delay-s", type=float, default=0.0)
    parser.add_argument("--writer-delay-s", type=float, default=0.0)
    parser.add_argument("--pretend-transformer-engine", action="store_true")
    parser.add_argument("--kill-in-partial-rollout-of-step", type=int, default=0)
    parser.add_argument("--full-disk-at-log-step", type=int, default=0)
    parser.add_argument("--full-disk-at-save-step", type=int, default=0)
    parser.add_argument("--crash-after-rollout-of-step", type=int, default=0)
    parser.add_argument("--rollout-error-at-step", type=int, default=0)
    args, rest = parser.parse_known_args()
    if args.full_disk_at_log_step:
        fill_disk_at_log_step(args.full_disk_at_log_step)
    if args.full_disk_at_save_step:
        fill_disk_at_save_step(args.full_disk_at_save_step)
    if args.nan_steps:
        inject_nan_losses({int(x) for x in args.nan_steps.split(",")})
    if args.checkpoint_delay_s:
        delay_checkpoint_commits(args.checkpoint_delay_s)
    if args.writer_delay_s:
        delay_checkpoint_writers(args.writer_delay_s)
    if args.pretend_transformer_engine:
        pretend_transformer_engine()
    if args.kill_in_partial_rollout_of_step:
        kill_in_partial_rollout(args.kill_in_partial_rollout_of_step)
    if args.crash_after_rollout_of_step:
        crash_after_rollout(args.crash_after_rollout_of_step)
    if args.rollout_error_at_step:
        rollout_error_at(args.rollout_error_at_step)
    sys.exit(main([a for a in rest if a != "--"]))
