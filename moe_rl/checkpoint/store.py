"""Checkpoints on megatron-core's ``dist_checkpointing``: sharded, written in the
background, atomic, and resumable under another parallel layout.

Layout of ``run_dir/checkpoints/step_000010/``:

- ``dist/``: the policy's model and optimizer as megatron sharded state dicts (torch_dist
  format): every tensor is stored once, as a slice of its global tensor, so a run saved
  under one TP / PP / EP / DP layout resumes under any other (megatron reshards on load;
  the distributed optimizer's state is saved ``fully_reshardable``: gathered over the
  data-parallel ranks at save). With ``train.checkpoint_reshardable=false`` it is saved
  ``dp_reshardable`` instead: each rank writes its own shard as its buckets hold it, with
  no gather, and a resume may change the data-parallel size only (another TP / PP / EP /
  ETP or stage split is refused in one line, as are other gradient buckets);
- ``rng/rank_00000.pt``: each rank's RNG states (tensors and plain data only, loaded with
  ``weights_only=True``); a resume under another layout takes the first rank's CPU
  generators and leaves the model-parallel RNG tracker as seeded;
- ``hf/``: the model's ``config.json`` and tokenizer files (what ``moe-rl export`` needs
  besides the weights to write a Hugging Face directory from any checkpoint);
- ``model/`` (the last step's checkpoint, and every ``train.export_every`` steps): the
  weights as a Hugging Face directory, ready for ``moe-rl eval``, transformers and SGLang;
- ``meta.json``, written last: format, step, world size, layout, the run's fingerprint,
  ``transformer_impl`` (``local`` or ``transformer_engine``), ``optimizer_sharding`` (and
  for ``dp_reshardable`` the gradient buckets it is laid out by), and the manifest (every file's
  size and CRC-32) with a seal over all of it (``verify.py``). A directory without it is
  incomplete and ignored; one that fails verification is skipped with a warning.

A save stages the state (device to host) and returns; a forked writer per rank writes the
files while training goes on. It becomes the checkpoint (``meta.json``, one rename) once
every rank's writer is done: checked without blocking after each step, and waited for
before the next save and at the end of the run. A crash before that leaves a temporary
directory that the next start removes; resuming then takes the checkpoint before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch
from megatron.core.transformer.module import MegatronModule

from moe_rl.checkpoint.catalog import (
    DP_RESHARDABLE,
    FORMAT,
    RESHARDABLE,
    CheckpointMismatch,
    checkpoint_dirs,
    layout_meta,
    layout_problem,
    read_meta,
    rng_file,
    rng_rank,
)
from moe_rl.checkpoint.verify import ROLLOUT_CARRY, SUMS, manifest_of, report_model_sums, sealed, summing_writer
from moe_rl.disk import OutOfSpace, nearly_full, space_error
from moe_rl.models.hf_weights import export_hf_weights, write_config_files
from parallel.collectives import all_gather_objects, barrier, broadcast_object, rank, world_size
from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings, choose_adam_kernel, shards_optimizer_state

log = logging.getLogger("moe_rl.train")


@contextlib.contextmanager
def _space_named(path: Path) -> Iterator[None]:
    """A failure for lack of space in the block becomes :class:`OutOfSpace` naming the file,
    or ``path`` (a checkpoint writer's write to an open file names none)."""
    try:
        yield
    except BaseException as e:  # (torch's CheckpointException, which wraps the writers' failures, is one)
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or (space_error(e) is None and not nearly_full(path)):
            raise
        raise OutOfSpace(path, e) from e


def optimizer_settings_for(settings: OptimSettings, resume_from: tuple[Path, dict] | None) -> OptimSettings:
    """``settings`` with the distributed optimizer on or off as in the checkpoint a run
    resumes from (megatron-core's two optimizers store their state in different forms),
    where ``optim.use_distributed_optimizer`` leaves the choice open; set otherwise, it
    must agree."""
    if resume_from is None:
        return settings
    path, meta = resume_from
    saved = meta.get("distributed_optimizer")
    if saved is None or settings.use_distributed_optimizer == saved:
        return settings
    if settings.use_distributed_optimizer is None:
        if not saved and shards_optimizer_state(settings) and rank() == 0:
            log.warning(
                "resuming %s with the plain optimizer it was saved with, although this layout's data-parallel ranks "
                "would shard its state (the distributed optimizer): each rank holds the whole optimizer state of its "
                "model shard",
                path,
            )
        return dataclasses.replace(settings, use_distributed_optimizer=saved)
    raise CheckpointMismatch(
        f"checkpoint {path} holds the {'distributed' if saved else 'plain'} optimizer's state and "
        f"optim.use_distributed_optimizer={settings.use_distributed_optimizer}: leave it unset (null) to resume"
    )


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds of this rank: its model stage and the optimizer over it."""

    model: MegatronModule
    optimizer: Any  # megatron-core MegatronOptimizer (chained over dense and expert parameters)
    settings: OptimSettings  # what built the optimizer
    optimizer_sharding: str = RESHARDABLE  # megatron's distrib_optim_sharding_type (RESHARDABLE / DP_RESHARDABLE)

    @property
    def distributed_optimizer(self) -> bool:
        return shards_optimizer_state(self.settings)

    def sharded_state_dict(self, loading: bool) -> dict:
        if loading:
            _give_adam_its_state(self.optimizer)
        model = self.model.sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": self.optimizer_sharding}
        optimizer = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=metadata)
        return {"model": model, "optimizer": optimizer}

    def load(self, state: dict, extra_state_absent: bool = False) -> None:
        """``extra_state_absent``: the checkpoint lacks some of the model's ``_extra_state``
        entries (written under the other ``transformer_impl``), the only keys not checked."""
        self.model.load_state_dict(state["model"], strict=not extra_state_absent)
        self.optimizer.load_state_dict(state["optimizer"])
        choose_adam_kernel(
            self.optimizer, self.settings.fused_adam
        )  # the loaded parameter groups carry the saving run's


def _give_adam_its_state(optimizer) -> None:
    """megatron-core 0.16.1's distributed optimizer reads Adam's step count from torch
    Adam's per-parameter state, which exists only after a first step: a fresh one gets
    megatron's own placeholder state (a step on zero gradients), replaced by the load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, DistributedOptimizer) and not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()


class Checkpointer:
    """Writes checkpoints of one run directory (at most one in flight) and keeps the last
    ``keep_last``. Every method but :meth:`abandon` is collective."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        keep_last: int,
        layout: ParallelLayout,
        model_files: tuple[Any, str],
        *,
        async_save: bool = True,
        reshardable: bool = True,
    ) -> None:
        """``model_files``: the HF config and the directory of the tokenizer files each
        checkpoint carries in ``hf/``. ``reshardable`` (``train.checkpoint_reshardable``):
        the distributed optimizer's state ``fully_reshardable``, else ``dp_reshardable``."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.root = Path(run_dir) / "checkpoints"
        self.hf_config, self.tokenizer_dir = model_files
        self.keep_last = keep_last
        self.layout = layout
        self.async_save = async_save
        self.reshardable = reshardable
        self._writes = AsyncCallsQueue()
        self._strategy = None  # megatron's save strategy, made at the first save (it caches which rank writes what)
        self._pruning: threading.Thread | None = None  # deleting checkpoints beyond keep_last (first rank)
        self._writing: Path | None = None  # the temporary directory of the last save started

    def save(
        self, step: int, state: TrainingState, extra: dict, *, hf_weights: bool = False, rollout_carry: object = None
    ) -> Path:
        """Stage this rank's state and start writing ``step_<step>``; returns its final
        path (complete once :meth:`wait`, or a :meth:`poll` that finds it written, commits
        it). ``hf_weights``: also write the weights as a HF directory, ``model/``;
        ``rollout_carry`` (first rank, partial rollouts): the responses carried into the
        next step, plain data and tensors, in ``rollout/carry.pt``. A lack of
        space while writing it raises :class:`OutOfSpace` (here or from a later
        :meth:`poll` / :meth:`wait`); nothing is committed then."""
        self.wait()
        _writer_reports_die_with_this_process()
        # a name of its own: a writer a killed run left behind may still be writing an earlier one
        final = self.root / f"step_{step:06d}"
        tmp = self.root / cast(
            str, broadcast_object(f".tmp_step_{step:06d}.{uuid.uuid4().hex[:8]}" if rank() == 0 else None)
        )
        self._writing = tmp
        with _space_named(tmp):
            self._start_save(step, state, extra, hf_weights, tmp, final, rollout_carry)
        return final

    def _start_save(
        self,
        step: int,
        state: TrainingState,
        extra: dict,
        hf_weights: bool,
        tmp: Path,
        final: Path,
        rollout_carry: object = None,
    ) -> None:
        """:meth:`save`'s work: this rank's files staged in ``tmp``, its writer started."""
        from megatron.core import dist_checkpointing

        if rank() == 0:
            (tmp / "dist").mkdir(parents=True)
            (tmp / "rng").mkdir()
            (tmp / "hf").mkdir()
            (tmp / SUMS).mkdir()
            write_config_files(self.hf_config, tmp / "hf", self.tokenizer_dir)
            if rollout_carry is not None:
                (tmp / ROLLOUT_CARRY).parent.mkdir()
                torch.save(rollout_carry, tmp / ROLLOUT_CARRY)
        barrier()
        if hf_weights:
            export_hf_weights(
                state.model,
                self.hf_config,
                tmp / "model",
                dtype=next(state.model.parameters()).dtype,
                copy_files_from=self.tokenizer_dir,
            )
            report_model_sums(tmp, rank(), world_size())
        torch.save(_rng_state(), tmp / rng_file(rank()))
        # (the plain optimizer's state is in model space either way)
        sharding = RESHARDABLE if self.reshardable or not state.distributed_optimizer else DP_RESHARDABLE
        state = dataclasses.replace(state, optimizer_sharding=sharding)
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size(),
            "layout": layout_meta(self.layout),
            "distributed_optimizer": state.distributed_optimizer,
            "hf_weights": hf_weights,
            "weights_dtype": str(next(state.model.parameters()).dtype).removeprefix("torch."),
            "transformer_impl": transformer_impl_of(state.model),
            "optimizer_sharding": sharding,
            **({"optimizer_buckets": optimizer_buckets(state.optimizer)} if sharding == DP_RESHARDABLE else {}),
            **extra,
        }
        self._strategy = self._strategy or _save_strategy()
        request = dist_checkpointing.save(
            state.sharded_state_dict(loading=False),
            tmp / "dist",
            sharded_strategy=self._strategy,
            async_sharded_save=True,
        )
        if request.async_fn is not None:  # (None: nothing for this rank to write)
            request = request._replace(async_fn=summing_writer(request.async_fn, tmp, rank()))
        request.add_finalize_fn(lambda: self._commit(tmp, final, meta))
        if self.async_save:
            self._writes.schedule_async_request(request)
        else:
            request.execute_sync()
            barrier()

    def writing(self) -> bool:
        """Whether this rank's writer is still writing a checkpoint (no collective)."""
        return any(
            call.async_caller.process is not None and call.async_caller.process.is_alive()
            for call in self._writes.async_calls
        )

    def poll(self) -> None:
        """Commit a checkpoint whose writers have all finished; never waits for them."""
        with _space_named(self._writing or self.root):
            self._writes.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Wait for the checkpoint being written and commit it (and for old ones to be gone)."""
        with _space_named(self._writing or self.root):
            self._writes.maybe_finalize_async_calls(blocking=True)
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None
        barrier()

    def abandon(self) -> None:
        """This rank alone (after a failure): let a running writer finish its files, commit
        nothing (the temporary directory is removed at the next start)."""
        for call in self._writes.async_calls:
            call.async_caller.close()
        self._writes.async_calls.clear()

    def _commit(self, tmp: Path, final: Path, meta: dict) -> None:
        """First rank: make ``tmp`` the checkpoint, then drop the oldest beyond
        ``keep_last`` (renamed aside at once, deleted on a thread: deleting terabytes on a
        parallel file system must not hold up the other ranks, which wait here)."""
        if rank() != 0:
            return
        meta = sealed(meta, manifest_of(tmp))
        shutil.rmtree(tmp / SUMS)
        _fsync_tree(tmp, skip_suffix=".distcp")  # megatron's writers fsync their own files
        commit_checkpoint(tmp, final, meta)
        old = [path for _, path in checkpoint_dirs(self.root.parent)[: -self.keep_last]]
        aside = [path.rename(path.with_name(f".old_{path.name}")) for path in old]
        if aside:
            self._pruning = threading.Thread(
                target=_remove_all,
                args=(aside,),
                name="checkpoint-prune",
                daemon=True,
            )
            self._pruning.start()


def load_rollout_carry(path: Path) -> object | None:
    """What :meth:`Checkpointer.save` kept as ``rollout_carry`` (``None``: nothing)."""
    carry = path / ROLLOUT_CARRY
    return torch.load(carry, weights_only=True) if carry.is_file() else None


def load_checkpoint(
    path: Path, meta: dict, state: TrainingState, layout: ParallelLayout, *, parallel: bool = True
) -> None:
    """Collective. Restores model, optimizer and RNG (see :func:`select_checkpoint`),
    resharded when ``layout`` or the world size differs from the checkpoint's.
    ``parallel``: megatron's fully parallel load over the data-parallel ranks (what they
    all need is read once, by one of them, and broadcast), else each rank reads what it
    holds itself: a ``fully_reshardable`` optimizer state, which every data-parallel rank
    reads whole before it keeps its shard, read by every one of them."""
    problem = layout_problem(path, meta, layout)
    sharding = meta.get("optimizer_sharding", RESHARDABLE)  # (unrecorded: written before dp_reshardable existed)
    if (
        problem is None
        and sharding == DP_RESHARDABLE
        and meta.get("optimizer_buckets") != optimizer_buckets(state.optimizer)
    ):
        problem = (
            f"checkpoint {path} holds the optimizer state by gradient bucket (train.checkpoint_reshardable=false), "
            "and this run's buckets differ from the ones it was saved with (optim.overlap_grad_reduce changed, or "
            "the model): resume with the settings it was saved with"
        )
    if problem:
        raise CheckpointMismatch(problem)
    state = dataclasses.replace(state, optimizer_sharding=sharding)
    loaded, absent = _load_sharded(
        state.sharded_state_dict(loading=True), path, transformer_impl_of(state.model), parallel=parallel
    )
    state.load(loaded, extra_state_absent=absent)
    same_layout = meta.get("layout") == layout_meta(layout) and meta["world_size"] == world_size()
    if not same_layout and rank() == 0:
        log.info(
            "checkpoint %s was written under %s on %d processes: resharded to %s on %d",
            path,
            meta.get("layout"),
            meta["world_size"],
            layout_meta(layout),
            world_size(),
        )
    _set_rng_state(torch.load(path / rng_file(rng_rank(meta)), weights_only=True), tracker=same_layout)


def optimizer_buckets(optimizer: Any) -> dict[str, list[list[int]]]:
    """Collective: the unpadded size of every gradient bucket of each distributed-optimizer part
    (``"<part>.<model-parallel group>"``), the structure a ``dp_reshardable`` state is stored
    in; megatron asserts it equal on load, checked here first to refuse in one line."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    mine = {
        f"{i}.{part.data_parallel_group_idx}": [
            [n for sizes in buffer.values() for n in sizes] for buffer in part.per_bucket_numel_unpadded
        ]
        for i, part in enumerate(getattr(optimizer, "chained_optimizers", [optimizer]))
        if isinstance(part, DistributedOptimizer)
    }
    return dict(sorted({k: v for part in all_gather_objects(mine) for k, v in part.items()}.items()))


_WRITER_REPORTS: list = []  # the manager serving megatron's writer-results queue (kept alive here)


def _writer_reports_die_with_this_process() -> None:
    """megatron's background writers report through a queue served by a manager process it
    spawns at the first save, which outlives a trainer killed with ``kill -9``: serve that
    queue from a manager started here instead, set to die with this process."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from parallel.launch import die_with_parent

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        _WRITER_REPORTS.append(manager)
        filesystem_async._results_queue = _WriterReports(manager.Queue(), os.getpid())


class _WriterReports:
    """The writer-results queue, for a writer whose trainer was killed (its manager gone
    with it): one line and a quiet exit instead of a traceback from the failed report."""

    def __init__(self, queue: Any, trainer: int) -> None:
        self._queue, self._trainer = queue, trainer

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        try:
            self._queue.put(item, *args, **kwargs)
        except (OSError, EOFError):
            if self._trainer in (os.getpid(), os.getppid()):  # the trainer itself, or a writer it still waits for
                raise
            with contextlib.suppress(OSError):
                print(
                    f"moe-rl: checkpoint writer {os.getpid()}: its trainer is gone; nothing committed", file=sys.stderr
                )
            os._exit(1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def load_weights(path: Path, model: MegatronModule) -> None:
    """Collective: the weights of checkpoint ``path`` (written under any layout) into this
    rank's ``model``; the optimizer state is not read."""
    # (each rank reads its own: export loads the weights once; resumes share the reads)
    loaded, absent = _load_sharded(
        {"model": model.sharded_state_dict()}, path, transformer_impl_of(model), parallel=False
    )
    model.load_state_dict(loaded["model"], strict=not absent)


def transformer_impl_of(model: torch.nn.Module) -> str:
    """``transformer_engine`` where any of ``model``'s layers is Transformer Engine's, else ``local``."""
    te = ("transformer_engine", "megatron.core.extensions.transformer_engine")
    return "transformer_engine" if any(type(m).__module__.startswith(te) for m in model.modules()) else "local"


def _load_sharded(request: dict, path: Path, impl: str, *, parallel: bool) -> tuple[dict, bool]:
    """Collective: ``request`` read from ``path/dist`` (``parallel``: megatron's fully
    parallel load over the data-parallel ranks), and whether some of its ``_extra_state``
    entries were absent (left out: Transformer Engine's layers hold some the local ones do
    not; the checkpoint's own extra entries are not read). Any other absent key refuses the
    checkpoint in one line naming both implementations."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from moe_rl.checkpoint.parallel_load import parallel_load_strategy

    loaded, _, absent = dist_checkpointing.load(
        request,
        str(path / "dist"),
        sharded_strategy=parallel_load_strategy(path) if parallel else None,
        strict=StrictHandling.RETURN_UNEXPECTED,
    )
    keys = sorted({str(getattr(k, "key", k)) for k in absent})
    # (each rank's own keys: every rank refuses together)
    others = sorted({k for ks in all_gather_objects(keys) for k in ks if not k.endswith("_extra_state")})
    saved = (read_meta(path) or {}).get("transformer_impl")  # (None: written before it was recorded)
    if others:
        raise CheckpointMismatch(
            f"checkpoint {path} lacks {len(others)} of this model's entries (e.g. {others[0]}): written with "
            f"transformer_impl={saved or 'unrecorded'}, read with {impl}, or by another model"
        )
    if saved not in (None, impl) and rank() == 0:
        log.info("checkpoint %s was written with transformer_impl=%s, read with %s", path, saved, impl)
    return loaded, bool(keys)


def sharded_weights_dtype(path: Path) -> torch.dtype:
    """The precision checkpoint ``path`` holds its weights in (the training precision)."""
    meta = read_meta(path)
    if meta is None or "weights_dtype" not in meta:
        raise ValueError(f"{path} is not a complete moe-rl checkpoint (meta.json with weights_dtype)")
    return getattr(torch, meta["weights_dtype"])


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


def _save_strategy():
    """torch_dist, each replicated tensor written by one data-parallel rank (fully parallel)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), group, do_cache_distribution=True
    )


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = np.random.get_state()
    assert isinstance(state, tuple)  # (the legacy form, the default)
    name, keys, pos, has_gauss, gauss = state
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "tracker": get_cuda_rng_tracker().get_states(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict, tracker: bool) -> None:
    """Restore the CPU generators, and (``tracker``: same layout) the device and
    model-parallel ones."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if tracker:
        get_cuda_rng_tracker().set_states(state["tracker"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def _fsync_tree(root: Path, skip_suffix: str | None = None) -> None:
    """Flush every file under ``root`` (but those ending in ``skip_suffix``, flushed by
    whoever wrote them) and the directories to disk before the rename."""
    for folder, _, files in os.walk(root):
        for name in files:
            if skip_suffix is None or not name.endswith(skip_suffix):
                with open(os.path.join(folder, name), "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
