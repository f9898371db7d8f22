"""Checkpoints: saved atomically (a temporary directory, fsynced, renamed once complete),
the last K kept, resumed exactly (model, optimizer, RNG states, step; the data position
follows from the step).

Layout of ``run_dir/checkpoints/step_000010/``: ``model/`` (HF safetensors in the
training precision: any parallel layout, ``moe-rl export`` and SGLang can read it),
``optim/rank_00000.pt`` (each rank's optimizer state), ``rng/rank_00000.pt`` (both
tensors and plain data only: loaded with ``weights_only=True``, never running pickled
code) and ``meta.json`` (written last: step, world size, the run's config fingerprint; a
directory without it is incomplete and ignored). Resuming takes the newest checkpoint
whose files are all there and readable, warning about any newer one that is not.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from moe_rl.config import ConfigError
from moe_rl.models.hf_weights import export_hf_weights, load_hf_weights
from parallel.collectives import any_rank, barrier, rank, world_size

log = logging.getLogger("moe_rl.train")
_STEP = re.compile(r"step_(\d+)$")


class CheckpointMismatch(ConfigError):
    """A checkpoint this run cannot continue from (another world size)."""


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
    return meta if isinstance(meta, dict) and isinstance(meta.get("step"), int) and isinstance(meta.get("world_size"), int) else None


def newest_meta(run_dir: str | os.PathLike) -> dict | None:
    """The ``meta.json`` of the newest checkpoint that has a readable one."""
    for _, path in reversed(checkpoint_dirs(run_dir)):
        meta = read_meta(path)
        if meta is not None:
            return meta
    return None


def select_checkpoint(run_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """Collective. The newest checkpoint every rank can load (its meta, model index and
    this rank's optimizer and RNG files present and readable), warning about newer ones
    that are not; ``None`` when there is none. Another world size raises."""
    for _, path in reversed(checkpoint_dirs(run_dir)):
        meta = read_meta(path)
        if meta is not None and meta["world_size"] != world_size():
            raise CheckpointMismatch(f"checkpoint {path} was written by {meta['world_size']} processes, this run has {world_size()}")
        problem = _unusable(path, meta)
        if not any_rank(problem is not None):
            return path, meta
        if rank() == 0:
            log.warning("skipping checkpoint %s: %s", path, problem or "unusable on another rank")
    return None


def _unusable(path: Path, meta: dict | None) -> str | None:
    if meta is None:
        return "meta.json is empty or unreadable"
    for needed in ("model/config.json", "model/model.safetensors.index.json", f"optim/rank_{rank():05d}.pt", f"rng/rank_{rank():05d}.pt"):
        file = path / needed
        if not file.is_file() or file.stat().st_size == 0:
            return f"{needed} is missing or empty"
    return None


def _optimizer_state(optimizer) -> list:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    out = []
    for opt in parts:
        state = {"state_dict": opt.state_dict()}
        if hasattr(opt, "get_parameter_state_dp_reshardable"):
            param_state = opt.get_parameter_state_dp_reshardable()
            # megatron-core 0.16.1's loader filters on a 'padding' flag its getter never sets
            for key, by_dtype in param_state.items():
                if isinstance(key, int):
                    for buckets in by_dtype.values():
                        for bucket in buckets:
                            for elem in bucket:
                                elem.setdefault("padding", False)
            state["param_state"] = param_state
        state["adam_steps"] = [_adam_step(opt, p) for p in _inner_params(opt)]
        out.append(state)
    return out


@torch.no_grad()
def _load_optimizer_state(optimizer, saved: list) -> None:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) != len(saved):
        raise ValueError("the checkpoint's optimizer does not match this run's (parallel layout changed?)")
    for opt, state in zip(parts, saved):
        opt.load_state_dict(state["state_dict"])
        if "param_state" in state:
            opt.load_parameter_state_from_dp_reshardable(state["param_state"])
        # torch Adam keeps its step count per parameter, outside megatron's parameter state
        for param, step in zip(_inner_params(opt), state.get("adam_steps", [])):
            if step is not None:
                opt.optimizer.state[param]["step"] = step.clone() if torch.is_tensor(step) else step


def _inner_params(opt) -> list:
    inner = getattr(opt, "optimizer", None)
    return [p for group in inner.param_groups for p in group["params"]] if inner is not None else []


def _adam_step(opt, param):
    step = opt.optimizer.state.get(param, {}).get("step")
    return step.clone() if torch.is_tensor(step) else step


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},  # fmt: skip
        "tracker": get_cuda_rng_tracker().get_states(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir, step: int, model, hf_config, optimizer, extra: dict, keep_last: int, tokenizer_dir=None) -> Path:
    """Collective. Writes ``step_<step>`` atomically and prunes to the last ``keep_last``."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "optim").mkdir(parents=True)
        (tmp / "rng").mkdir()
    barrier()
    export_hf_weights(model, hf_config, tmp / "model", dtype=next(model.parameters()).dtype, copy_files_from=tokenizer_dir)
    torch.save(_optimizer_state(optimizer), tmp / "optim" / f"rank_{rank():05d}.pt")
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank():05d}.pt")
    barrier()
    if rank() == 0:
        _fsync_tree(tmp)
        commit_checkpoint(tmp, final, {"step": step, "world_size": world_size(), **extra})
        for _, old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def commit_checkpoint(tmp: Path, final: Path, meta: dict) -> None:
    """Make the complete temporary directory ``tmp`` the checkpoint ``final``:
    ``meta.json`` last, then one rename (a crash before it leaves only ``tmp``)."""
    with open(tmp / "meta.json", "w") as f:
        f.write(json.dumps(meta, indent=2))
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def load_checkpoint(path: Path, model, hf_config, optimizer) -> None:
    """Collective. Restores model, optimizer and RNG (see :func:`select_checkpoint`)."""
    load_hf_weights(model, hf_config, path / "model")
    _load_optimizer_state(optimizer, torch.load(path / "optim" / f"rank_{rank():05d}.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng" / f"rank_{rank():05d}.pt", weights_only=True))


def remove_stale_temporaries(run_dir: str | os.PathLike) -> None:
    """Temporary checkpoint directories a killed run left behind (first rank)."""
    root = Path(run_dir) / "checkpoints"
    if rank() == 0 and root.is_dir():
        for tmp in root.glob(".tmp_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` (and the directories) to disk before the rename."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
