"""What a run directory's checkpoints are, and which of them can be trusted: the committed
``step_N`` directories, their ``meta.json``, the checks a resume, an export, ``eval`` and
``drift`` make before they read one (``verify.py``'s manifest and seal), the newest intact one
a resume takes, and the damaged ones it sets aside (``step_N.damaged``). Saving and loading
are :mod:`moe_rl.checkpoint.store`'s."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from moe_rl.checks import ConfigError
from moe_rl.checkpoint.verify import model_files_problem, seal_problem, verification_problem
from parallel.collectives import all_gather_objects, barrier, rank, world_size
from parallel.layout import ParallelLayout

log = logging.getLogger("moe_rl.train")

_STEP = re.compile(r"step_(\d+)$")


DAMAGED_SUFFIX = ".damaged"  # a checkpoint a resume skipped, set aside (never matched by _STEP)


FORMAT = 2  # meta.json "format": megatron dist_checkpointing (format 1: HF weights + per-rank optimizer files)
# megatron's distrib_optim_sharding_type for the distributed optimizer's state.
# fully_reshardable: in model space (each parameter's fp32 copy and Adam moments shaped as the
# parameter, gathered over the data-parallel ranks at save), so it reshards over TP / PP / EP / DP
# like the weights. dp_reshardable: each rank's own shard of its gradient buckets, no gather; only
# the data-parallel size may change on resume (train.checkpoint_reshardable=false)
RESHARDABLE, DP_RESHARDABLE = "fully_reshardable", "dp_reshardable"


class CheckpointMismatch(ConfigError):
    """A checkpoint this run cannot continue from."""


def checkpoint_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, path)``, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP.match(p.name)
            if m and (p / "meta.json").is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> tuple[int, Path] | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def read_meta(path: Path) -> dict | None:
    """A checkpoint's ``meta.json``, or ``None`` when it is unreadable or incomplete."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return (
        meta
        if isinstance(meta, dict) and isinstance(meta.get("step"), int) and isinstance(meta.get("world_size"), int)
        else None
    )


def newest_readable(run_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """The newest checkpoint whose ``meta.json`` is readable and matches its seal, and that meta."""
    for _, path in reversed(checkpoint_dirs(run_dir)):
        meta = read_meta(path)
        if meta is not None and seal_problem(meta) is None:
            return path, meta
    return None


def format_problem(path: Path, meta: dict) -> str | None:
    """Why this version cannot resume from a checkpoint of another format, with the way out."""
    if meta.get("format") == FORMAT:
        return None
    return (
        f"checkpoint {path} was written by an earlier moe-rl (per-rank optimizer files, one parallel layout) and cannot be "
        f"resumed by this version: start a new run from its weights (model.hf_dir={path / 'model'}, or "
        f"`moe-rl export --checkpoint {path} --out DIR` and model.hf_dir=DIR) in another train.run_dir"
    )


def select_checkpoint(run_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """Collective. The newest checkpoint that passes verification on every rank; newer ones
    that do not are warned about and, once an intact one is found, set aside
    (:func:`set_aside`); ``None`` when the run directory holds none. A checkpoint of an
    earlier format, or checkpoints none of which is intact (all left in place), raise."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(checkpoint_dirs(run_dir)):
        meta = read_meta(path)
        if meta is not None and format_problem(path, meta):
            raise CheckpointMismatch(format_problem(path, meta))
        problem = checkpoint_problem(path, meta)
        if problem is None and meta is not None:
            if rank() == 0:
                for damaged, why in skipped:
                    log.warning("skipping checkpoint %s: %s; set aside as %s", damaged, why, set_aside(damaged).name)
            barrier()  # every rank sees the run directory as the first rank left it
            return path, meta
        skipped.append((path, problem or "meta.json is empty or unreadable"))
    if skipped:
        if rank() == 0:
            for damaged, why in skipped:
                log.warning("skipping checkpoint %s: %s", damaged, why)
        reasons = "; ".join(f"{path.name}: {why}" for path, why in skipped)
        raise CheckpointMismatch(
            f"no intact checkpoint in {Path(run_dir) / 'checkpoints'} ({reasons}): nothing was loaded or "
            "deleted; move the damaged ones aside to start over from an older one, or choose another train.run_dir"
        )
    return None


def set_aside(path: Path) -> Path:
    """Rename the damaged checkpoint ``path`` out of the run's way, to ``step_N.damaged``
    (``.damaged.2``, ... if taken): kept for a look, never counted by ``keep_last``, never
    overwritten by the next save of its step. Its new path."""
    target, n = path.with_name(path.name + DAMAGED_SUFFIX), 2
    while target.exists():
        target, n = path.with_name(f"{path.name}{DAMAGED_SUFFIX}.{n}"), n + 1
    path.rename(target)
    return target


def model_problem(path: Path) -> str | None:
    """Why a training checkpoint's ``model/`` (its HF weights) cannot be trusted: an unreadable
    or unsealed ``meta.json``, a file of it missing, of another size or with another CRC-32
    than the manifest recorded at commit. One process reads every file once. A checkpoint
    committed before ``model/`` was in the manifest passes with a warning."""
    meta = read_meta(path)
    if meta is None:
        return "meta.json is empty or unreadable"
    problem = seal_problem(meta) or model_files_problem(path, meta)
    if problem is None and "model/config.json" not in meta.get("manifest", {}):
        log.warning("checkpoint %s: its model/ was written before moe-rl recorded its checksums (not verified)", path)
    return problem


def checkpoint_problem(path: Path, meta: dict | None) -> str | None:
    """Collective. Why the checkpoint at ``path`` cannot be trusted (the first rank's
    reason, or another's), or ``None``; each rank sums its share of the files. A
    checkpoint without a manifest is accepted with a warning when its files are there."""
    problem = _unusable(path, meta)
    if problem is None and meta is not None:
        try:
            problem = verification_problem(path, meta, (rank(), world_size()))
        except OSError as e:
            problem = f"a file cannot be read ({e.strerror or e})"
    problems = [p for p in all_gather_objects(problem) if p]
    if problems:
        return problems[0]
    if meta is not None and "seal" not in meta and rank() == 0:
        log.warning(
            "checkpoint %s has no manifest (written before moe-rl recorded checksums): its files are checked for "
            "presence and size only",
            path,
        )
    return None


def _unusable(path: Path, meta: dict | None) -> str | None:
    if meta is None:
        return "meta.json is empty or unreadable"
    for needed in ("dist/metadata.json", "dist/.metadata", "dist/common.pt", rng_file(rng_rank(meta))):
        file = path / needed
        if not file.is_file() or file.stat().st_size == 0:
            return f"{needed} is missing or empty"
    return None


def layout_problem(path: Path, meta: dict, layout: ParallelLayout) -> str | None:
    """Why a run under ``layout`` cannot resume from the checkpoint at ``path`` (``meta``):
    a ``dp_reshardable`` optimizer state (``train.checkpoint_reshardable=false``) is laid out
    by its writer's model-parallel layout, so only the data-parallel size may differ."""
    saved = meta.get("layout")
    if meta.get("optimizer_sharding") != DP_RESHARDABLE or saved == layout_meta(layout):
        return None
    name = lambda lay: " ".join(f"{k}={v}" for k, v in lay.items())  # noqa: E731
    return (
        f"checkpoint {path} was saved with train.checkpoint_reshardable=false under {name(saved)}: its optimizer "
        f"state resumes only under that layout (any data-parallel size), not {name(layout_meta(layout))}; resume "
        "under it and save once with train.checkpoint_reshardable=true to change the layout"
    )


def verify_checkpoint(path: Path) -> None:
    """Collective: raise :class:`CheckpointMismatch` (one line) unless the checkpoint at
    ``path`` passes the checks a resume makes."""
    meta = read_meta(path)
    problem = checkpoint_problem(path, meta)
    if problem:
        raise CheckpointMismatch(f"checkpoint {path} cannot be trusted: {problem}")


def remove_stale_temporaries(run_dir: str | os.PathLike) -> None:
    """Temporary checkpoint directories a killed run left behind (first rank)."""
    root = Path(run_dir) / "checkpoints"
    if rank() == 0 and root.is_dir():
        for tmp in [*root.glob(".tmp_step_*"), *root.glob(".old_step_*")]:  # (and old ones a prune left half deleted)
            shutil.rmtree(tmp, ignore_errors=True)


def rng_file(r: int) -> str:
    return f"rng/rank_{r:05d}.pt"


def rng_rank(meta: dict) -> int:
    """The rank whose RNG file a resume reads: this one under the checkpoint's own world
    size, else the first."""
    return rank() if meta.get("world_size") == world_size() else 0


def layout_meta(layout: ParallelLayout) -> dict:
    """The model-parallel layout (the stage split only where set, as meta.json recorded it before)."""
    stages = {"first_stage_layers": layout.first_stage_layers, "last_stage_layers": layout.last_stage_layers}
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "etp": layout.expert_tp,
        **{k: v for k, v in stages.items() if v is not None},
    }
