"""A run directory belongs to one run. Checked on every rank before anything starts
(plain file reads): resuming with another config, or starting afresh over a run's
checkpoints (or over checkpoints none of which is readable), is a one-line error, and
nothing is ever deleted to make room."""

from __future__ import annotations

import os
from pathlib import Path

from moe_rl.config import Config, ConfigError, fingerprint_differences
from moe_rl.checkpoint.store import checkpoint_dirs, format_problem, newest_readable


def check_run_dir(cfg: Config) -> None:
    run_dir = Path(cfg.train.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.run_dir={str(run_dir)!r} cannot be created: {e.strerror or e}") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"train.run_dir={str(run_dir)!r} is not writable")
    if not checkpoint_dirs(run_dir):
        return
    if not cfg.train.resume:
        raise ConfigError(
            f"train.run_dir={str(run_dir)!r} already holds a run's checkpoints: continue it with train.resume=true, "
            "or choose another train.run_dir (nothing was deleted)"
        )
    newest = newest_readable(run_dir)
    if newest is None:
        names = ", ".join(path.name for _, path in checkpoint_dirs(run_dir))
        raise ConfigError(
            f"train.run_dir={str(run_dir)!r} holds checkpoints ({names}) none of which has a readable meta.json that "
            "matches its seal: nothing was started or deleted; restore or move them aside, or choose another "
            "train.run_dir"
        )
    problem = format_problem(*newest)
    if problem:
        raise ConfigError(problem)
    saved = newest[1].get("fingerprint")
    if saved is None or cfg.train.resume_anyway:
        return
    differences = fingerprint_differences(saved, cfg.fingerprint())
    if differences:
        shown = "; ".join(differences[:3]) + (f"; and {len(differences) - 3} more" if len(differences) > 3 else "")
        raise ConfigError(
            f"train.run_dir={str(run_dir)!r} holds a run with another config ({shown}): choose another train.run_dir, "
            "or set train.resume_anyway=true to continue it deliberately"
        )
