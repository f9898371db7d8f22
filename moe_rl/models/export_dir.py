"""Where an export may be written (a light module: ``moe-rl export`` checks ``--out``
before it starts any rank or imports megatron-core).

An export replaces its destination, so it only ever writes into a directory that is new,
empty, or one an earlier export made: every export leaves :data:`MARKER` in its directory
saying what wrote it. Any other directory (a base model's copy, a work folder) is refused
and left untouched."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

MARKER = ".moe-rl-export"  # in every export's directory: what wrote it (JSON)


def export_destination(out: str | os.PathLike) -> Path:
    """``out`` as an absolute, normalised path (``.``/``..`` resolved; symlinks kept) whose
    last component names the directory an export replaces."""
    if not str(out).strip():
        raise ValueError("an empty path names no directory: give one such as exports/step_100")
    path = Path(os.path.abspath(os.path.expanduser(out)))
    if path.parent == path:
        raise ValueError(f"{path} is a file system root: give a new directory below it")
    return path


def export_destination_problem(out: str | os.PathLike) -> str | None:
    """Why ``out`` may not receive an export (one line naming it, why, and what to do), or
    ``None``: a new or empty directory, or an earlier export (which is replaced). Checks
    that the directory's parent can be made and written to (a probe made and removed)."""
    try:
        path = export_destination(out)
    except ValueError as e:
        return str(e)
    if path.is_symlink():
        return f"{path} is a symbolic link (an export would replace the link): give the directory itself or a new one"
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory: give a new or empty directory"
    if path.is_dir() and any(path.iterdir()) and not (path / MARKER).is_file():
        return (
            f"{path} is not empty and was not written by moe-rl export (no {MARKER} in it): nothing was touched; "
            "give a new or empty directory"
        )
    return _unwritable_parent(path)


def _unwritable_parent(path: Path) -> str | None:
    """Why ``path``'s parent cannot be made or written to, or ``None``."""
    ancestor = path.parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{path} cannot be made: {ancestor} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=ancestor))
    except OSError as e:
        return f"{path} cannot be made: {ancestor} is not writable ({e.strerror})"
    return None


def write_marker(directory: Path, **facts: object) -> None:
    """Mark ``directory`` as an export: what wrote it, when, and ``facts`` (its source, dtype)."""
    from moe_rl import __version__

    made = {"written_by": f"moe-rl {__version__} export", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **facts}
    (directory / MARKER).write_text(json.dumps(made, indent=2) + "\n")
