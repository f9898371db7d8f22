"""A full disk (or a quota) under a run: found behind whatever wrapped it, said in one line.

A write that fails for lack of space surfaces in many forms: an ``OSError`` from a log
file, TensorBoard's writer thread re-raising it, megatron's checkpoint writer process
reporting it through torch's ``CheckpointException``. :func:`space_error` finds the
``ENOSPC`` / ``EDQUOT`` behind any of them; the command line prints :func:`out_of_space_line`
and exits non-zero, without a traceback.
"""

from __future__ import annotations

import errno
import os

SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class OutOfSpace(RuntimeError):
    """A write under ``path`` failed for lack of space (``cause``: the OSError behind it)."""

    def __init__(self, path: str | os.PathLike, cause: BaseException) -> None:
        self.path = str(path)
        super().__init__(out_of_space_line(cause, path) or _line("no space left on device", path))


def space_error(error: BaseException) -> OSError | None:
    """The ``ENOSPC`` / ``EDQUOT`` ``OSError`` behind ``error`` (one naming a file, where
    several are): itself, its causes and contexts, the exceptions in its arguments, and the
    per-rank failures torch's distributed checkpoint wraps (``CheckpointException.failures``);
    ``None`` when there is none."""
    found = _space_errors(error)
    return next((e for e in found if e.filename), found[0] if found else None)


def _space_errors(error: BaseException) -> list[OSError]:
    found: list[OSError] = []
    seen: set[int] = set()
    stack: list = [error]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in SPACE_ERRNOS:
            found.append(e)
            continue
        stack += [e.__cause__, e.__context__, *getattr(e, "args", ())]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            wrapped = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
            stack += wrapped
            # gathered from the ranks by pickling, which drops an exception's cause: the
            # writer's OSError survives only in the text of the error that wrapped it
            found += [
                OSError(code, os.strerror(code))
                for f in wrapped
                for code in SPACE_ERRNOS
                if f"[Errno {code}]" in str(f)
            ]
    return found


def nearly_full(path: str | os.PathLike, below: int = 1 << 20) -> bool:
    """Whether the filesystem under ``path`` (or its nearest existing parent) has less than
    ``below`` bytes free: what a write that failed without saying why (torch's zip writer
    reports a short write as "unexpected pos") left behind when the disk filled."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        stats = os.statvfs(folder)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < below


def out_of_space_line(error: BaseException, path: str | os.PathLike | None = None) -> str | None:
    """One line for ``error`` if a lack of space caused it (naming the file it names, else
    ``path``), else ``None``."""
    cause = space_error(error)
    if cause is None:
        return None
    why = "disk quota exceeded" if cause.errno == errno.EDQUOT else "no space left on device"
    return _line(why, cause.filename or path)


def _line(why: str, where: str | os.PathLike | None) -> str:
    return (
        f"{why}{f' writing {where}' if where else ''}: make room there and run the same command again (it resumes "
        "from the last checkpoint; the checkpoints before this write are intact)"
    )


def quiet_about_space(hook):
    """A ``threading.excepthook`` that stays quiet about a thread that failed for lack of
    space (the run reports it once, in one line) and calls ``hook`` for anything else."""

    def excepthook(args) -> None:
        if args.exc_value is None or space_error(args.exc_value) is None:
            hook(args)

    return excepthook


def with_path(error: OSError, path: str | os.PathLike) -> OSError:
    """``error`` (e.g. from writing an open file, which names no file) naming ``path``."""
    if error.filename:
        return error
    return type(error)(error.errno, error.strerror, str(path))
