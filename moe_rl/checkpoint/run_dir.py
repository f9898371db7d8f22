"""A run directory belongs to one run. The run holds an advisory lock on it for its
lifetime (:func:`hold_run_dir`: the first rank, ``flock`` on ``run.lock``, released by the
operating system however the process ends, ``kill -9`` included), so a second run on it is
refused in one line naming the holder. Checked on every rank before anything starts (plain
file reads): resuming with another config, or starting afresh over a run's checkpoints (or
over checkpoints none of which is readable), is a one-line error, and nothing is ever
deleted to make room."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from moe_rl.config import Config, ConfigError, fingerprint_differences
from moe_rl.checkpoint.catalog import checkpoint_dirs, format_problem, newest_readable


def make_run_dir(run_dir: Path) -> None:
    """``run_dir`` and its parents made (nothing when it is there); :class:`ConfigError` naming why not."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"train.run_dir={str(run_dir)!r} is a file: it must be a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.run_dir={str(run_dir)!r} cannot be created: {e.strerror or e}") from None


def check_run_dir(cfg: Config) -> None:
    run_dir = Path(cfg.train.run_dir)
    make_run_dir(run_dir)
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


LOCK_FILE = "run.lock"


class RunDirInUse(ConfigError):
    """Another live process holds the run directory."""


def _describe_self() -> str:
    command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: {command}"


def _try_lock(run_dir: Path) -> int | None:
    """``run.lock``'s descriptor, locked by this process; ``None`` while another holds it."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def holder_of(run_dir: str | os.PathLike) -> str | None:
    """Who holds ``run_dir`` now (what the holder wrote of itself), or ``None`` when no live
    process does (probed by taking the lock and dropping it at once)."""
    run_dir = Path(run_dir)
    if not (run_dir / LOCK_FILE).exists():
        return None
    fd = _try_lock(run_dir)
    if fd is not None:
        os.close(fd)
        return None
    return (run_dir / LOCK_FILE).read_text(errors="replace").strip() or "another process"


def live_run_holding(path: str | os.PathLike) -> tuple[Path, str] | None:
    """The live run directory ``path`` is in (or is) and its holder, or ``None``."""
    path = Path(path).resolve()
    for folder in (path, *path.parents):
        holder = holder_of(folder)
        if holder is not None:
            return folder, holder
    return None


def in_use_message(run_dir: str | os.PathLike, holder: str) -> str:
    return (
        f"train.run_dir={str(run_dir)!r} is in use by another run ({holder}): wait for it to end, or choose another "
        "train.run_dir (nothing was changed)"
    )


@contextlib.contextmanager
def hold_run_dir(run_dir: str | os.PathLike, *, first_rank: bool = True) -> Iterator[None]:
    """Hold ``run_dir``'s lock while the block runs (``first_rank``: other ranks take none);
    :class:`RunDirInUse` at once when another live process holds it. The lock file says who
    holds it; a process forked meanwhile (a checkpoint writer) keeps it until it ends."""
    if not first_rank:
        yield
        return
    run_dir = Path(run_dir)
    make_run_dir(run_dir)
    fd = _try_lock(run_dir)
    if fd is None:
        raise RunDirInUse(in_use_message(run_dir, holder_of(run_dir) or "another process"))
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (_describe_self() + "\n").encode())
        yield
    finally:
        os.close(fd)
