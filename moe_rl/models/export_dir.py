"""Where an export may be written (a light module: ``moe-rl export`` checks ``--out``
before it starts any rank or imports megatron-core)."""

from __future__ import annotations

import os
from pathlib import Path


def export_destination_problem(out: str | os.PathLike) -> str | None:
    """Why ``out`` may not receive an export, or ``None``: only a new or empty directory,
    or an earlier export (which is replaced), is ever written over."""
    out = Path(out)
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} exists and is not a directory"
    if any(out.iterdir()) and not (out / "model.safetensors.index.json").is_file():
        return f"{out} is not empty and holds no earlier export (model.safetensors.index.json): give an empty or new directory"
    return None
