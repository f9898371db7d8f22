"""Checkpoint cost on the 188M-parameter benchmark model: how long training is blocked by a
save, and the bytes written, side by side in one run.

    .venv/bin/python -m tools.bench.checkpoint [--repeats 3] [--json FILE]

Three ways to save the same policy (weights, fp32 Adam state after one update, RNG):

- ``format 1``: what moe-rl wrote before megatron's dist_checkpointing (the weights as a
  HF directory and the optimizer's ``state_dict`` with ``torch.save``, synchronously);
- ``sync``: :class:`moe_rl.checkpoint.store.Checkpointer` with ``async_save=False``;
- ``async``: the same in the background; *blocked* is the time ``save`` takes to return
  plus the commit's time when the writers are done (the trainer's ``poll``), *written*
  the time until the checkpoint is complete (the writers' checksums included);
- ``verify``: what a resume checks before it loads (one process: the seal, every file's
  size and CRC-32), on the ``sync`` checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def format_one(policy, out: Path) -> None:
    """The format-1 save: HF weights, the optimizer's state with torch.save, fsynced."""
    import torch

    from moe_rl.models.hf_weights import export_hf_weights
    from moe_rl.checkpoint.store import _fsync_tree

    export_hf_weights(policy.model, policy.hf_config, out / "model", dtype=torch.float32)
    (out / "optim").mkdir()
    torch.save([part.state_dict() for part in policy.optimizer.chained_optimizers], out / "optim" / "rank_00000.pt")
    _fsync_tree(out)


def new_format(policy, root: Path, step: int, background: bool) -> tuple[float, float, float]:
    """(seconds blocked, seconds until complete, seconds of the blocked time spent
    committing) of one :class:`Checkpointer` save."""
    from moe_rl.checkpoint.store import Checkpointer, TrainingState
    from parallel.layout import ParallelLayout

    ckpt = Checkpointer(
        root, keep_last=1, layout=ParallelLayout(), model_files=(policy.hf_config, None), async_save=background
    )
    state = TrainingState(policy.model, policy.optimizer, policy.optim_settings)
    start = time.perf_counter()
    final = ckpt.save(step, state, {})
    blocked = time.perf_counter() - start
    if background:  # training would go on here; the trainer polls after each step
        while ckpt.writing():
            time.sleep(0.01)
        written = time.perf_counter() - start
        commit = time.perf_counter()
        ckpt.poll()
        commit = time.perf_counter() - commit
        blocked += commit
    else:
        written, commit = blocked, 0.0
    assert (final / "meta.json").is_file()
    return blocked, written, commit


def verify(path: Path) -> float:
    """Seconds a one-process resume spends verifying the checkpoint at ``path``."""
    from moe_rl.checkpoint.catalog import read_meta
    from moe_rl.checkpoint.verify import verification_problem

    start = time.perf_counter()
    assert verification_problem(path, read_meta(path), (0, 1)) is None
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from tools.bench.mfu import random_batches, random_policy

    policy, _ = random_policy()
    policy.update(random_batches(1024, seq=256), lambda le, mb: (-le[..., 0].mean(), {}))  # Adam state exists
    params = sum(p.numel() for p in policy.model.parameters())
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint-"))
    times: dict[str, list[float]] = {
        "format 1": [],
        "sync": [],
        "async blocked": [],
        "async commit": [],
        "async written": [],
        "verify": [],
    }
    sizes: dict[str, int] = {}
    try:
        new_format(policy, work / "warm", 0, background=True)  # the writer pool's one-time start, not counted
        for r in range(args.repeats):
            out = work / f"f1-{r}"
            out.mkdir()
            start = time.perf_counter()
            format_one(policy, out)
            times["format 1"].append(time.perf_counter() - start)
            sizes["format 1"] = dir_bytes(out)
            shutil.rmtree(out)
            times["sync"].append(new_format(policy, work / f"sync-{r}", r + 1, background=False)[0])
            sizes["dist"] = dir_bytes(work / f"sync-{r}" / "checkpoints")
            times["verify"].append(verify(work / f"sync-{r}" / "checkpoints" / f"step_{r + 1:06d}"))
            shutil.rmtree(work / f"sync-{r}")
            blocked, written, commit = new_format(policy, work / f"async-{r}", r + 1, background=True)
            times["async blocked"].append(blocked)
            times["async commit"].append(commit)
            times["async written"].append(written)
            shutil.rmtree(work / f"async-{r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "params": params,
        "repeats": args.repeats,
        "seconds": med,
        "runs": times,
        "bytes": sizes,
        "blocked_over_sync": med["async blocked"] / med["sync"],
        "blocked_over_format1": med["async blocked"] / med["format 1"],
    }
    gb = 1e9
    print(f"checkpoint of a {params / 1e6:.0f}M-parameter policy (fp32 weights + Adam), median of {args.repeats}:")
    print(
        f"  format 1 (HF weights + torch.save optimizer, sync): {med['format 1']:.2f}s, {sizes['format 1'] / gb:.2f} GB"
    )
    print(f"  dist_checkpointing, sync:                          {med['sync']:.2f}s, {sizes['dist'] / gb:.2f} GB")
    print(
        f"  dist_checkpointing, async: blocked {med['async blocked']:.2f}s ({100 * result['blocked_over_sync']:.0f}% of sync; commit {med['async commit']:.2f}s), "
        f"written after {med['async written']:.2f}s"
    )
    print(
        f"  verification before a resume (one process): {med['verify']:.2f}s "
        f"({sizes['dist'] / gb / med['verify']:.2f} GB/s)"
    )
    print("BENCH_JSON " + json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    os._exit(0)  # megatron's writer pool (a spawned manager) need not be torn down


if __name__ == "__main__":
    main()
