"""A sharded megatron model's weights streamed to one rank in buckets of HF tensors.

Every rank computes the same plan: each parameter's full HF tensors (names, shapes) and
the rank that writes them (one per pipeline stage, one per expert-parallel rank for
experts: :func:`moe_rl.models.hf_weights.is_writer`), ordered by writer rank, then cut
into buckets of at most ``bucket_bytes``. Per bucket, the writers' tensor-parallel groups
gather their shards, each writer converts them to HF tensors and sends them to ``dst``
point to point; ``dst`` hands the bucket to a consumer (a broadcast to the servers) and
drops it. So no rank holds more than one bucket of full tensors (plus the parameter it is
gathering: twice the largest tensor), whatever the model's size; only the writers'
tensor-parallel groups take part (other data-parallel replicas just wait).

Every rank runs the same sequence of collectives in the same order, so it cannot deadlock.
Tensors travel on each rank's device (``cuda:<local rank>`` under NCCL, CPU under gloo).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from transformers import PretrainedConfig

from moe_rl.models.builder import named_weights
from moe_rl.models.hf_weights import ParamMapper, Recipe, export_hf_weights, gather_shards, is_writer, served_dtype
from parallel.collectives import all_gather_objects, rank, rank_device

NamedTensors = list[tuple[str, torch.Tensor]]
BucketConsumer = Callable[[NamedTensors], None]


@dataclass(frozen=True)
class WeightEntry:
    """One megatron parameter's full HF tensors, written by global rank ``writer``."""

    writer: int
    param: str  # its name on the writer and on the writer's tensor-parallel peers
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # (HF name, full shape)
    dtype: torch.dtype  # the parameter's own

    def numel(self) -> int:
        return sum(int(torch.Size(shape).numel()) for _, shape in self.tensors)

    def sent_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """What it is sent in when the sync's dtype is ``dtype`` (expert biases keep fp32)."""
        return served_dtype(self.param, self.dtype, dtype)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Its size sent in a sync of ``dtype`` (default: its own)."""
        return self.numel() * torch.empty((), dtype=self.sent_dtype(dtype)).element_size()


def plan_buckets(entries: list[WeightEntry], bucket_bytes: int, dtype: torch.dtype | None) -> list[list[WeightEntry]]:
    """``entries`` in order, cut into buckets of at most ``bucket_bytes`` sent in ``dtype``
    (default: each entry's own; an entry larger than that is a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size {bucket_bytes} bytes must be >= 1")
    buckets: list[list[WeightEntry]] = []
    size = 0
    for entry in entries:
        nbytes = entry.nbytes(dtype)
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(entry)
        size += nbytes
    return buckets


class WeightStreamer:
    """Streams ``model``'s weights as HF tensors to rank ``dst`` (see the module doc)."""

    def __init__(self, model: GPTModel, hf_config: PretrainedConfig, *, dst: int = 0) -> None:
        self.model = model
        self.mapper = ParamMapper(hf_config, model)
        self.dst = dst
        self.weights = self._current_weights()
        self.recipes = {name: self.mapper.recipe(name) for name in self.weights}
        self.writer_of = {name: _writer_rank(recipe, self.mapper) for name, recipe in self.recipes.items()}
        self.entries = self._global_entries()  # collective, once

    def _current_weights(self) -> dict[str, torch.Tensor]:
        tied = self.mapper.tied
        return {name: w for name, w in named_weights(self.model) if not (name == "output_layer.weight" and tied)}

    def _global_entries(self) -> list[WeightEntry]:
        me = rank()
        mine = [
            WeightEntry(me, name, self._full_shapes(name), self.weights[name].dtype)
            for name in self.weights if self.writer_of[name] == me
        ]  # fmt: skip
        return [entry for rank_entries in all_gather_objects(mine) for entry in rank_entries]

    def _full_shapes(self, name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        recipe = self.recipes[name]
        _, size = self.mapper._tp(recipe)
        shards = [torch.empty(self.weights[name].shape, device="meta") for _ in range(size)]
        return tuple((key, tuple(full.shape)) for key, full in zip(recipe.hf_keys, self.mapper.to_full(recipe, shards)))

    def total_bytes(self, dtype: torch.dtype) -> int:
        return sum(entry.nbytes(dtype) for entry in self.entries)

    @torch.no_grad()
    def send_buckets(self, bucket_bytes: int, dtype: torch.dtype | None, consume: BucketConsumer | None) -> int:
        """Collective: ``consume(bucket)`` on ``dst`` for each bucket of ``(HF name, tensor)``
        pairs (on its device, in ``dtype`` or the parameters' own; dropped before the next
        one is gathered); returns the number of buckets. Other ranks only send their shards.
        (A callback, not a generator: a suspended generator keeps its last bucket alive
        while it gathers the next, doubling the peak.)"""
        self.weights = self._current_weights()  # a buffer may have been replaced since
        plan = plan_buckets(self.entries, bucket_bytes, dtype)
        for entries in plan:
            bucket = self._move_bucket(entries, dtype)
            if bucket is not None and consume is not None:
                consume(bucket)
            del bucket
        return len(plan)

    def _move_bucket(self, bucket: list[WeightEntry], sync_dtype: torch.dtype | None) -> NamedTensors | None:
        me, device = rank(), rank_device()
        out: NamedTensors = []
        for entry in bucket:
            dtype = entry.sent_dtype(sync_dtype)
            if self.writer_of.get(entry.param) == entry.writer:  # this rank holds a shard of it
                full = self._gather_full(entry.param, dtype, device)
                if me == self.dst:
                    out += full
                elif me == entry.writer:
                    for _, tensor in full:
                        dist.send(tensor, dst=self.dst)
            elif me == self.dst:
                for key, shape in entry.tensors:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(tensor, src=entry.writer)
                    out.append((key, tensor))
        return out if me == self.dst else None

    def _gather_full(self, name: str, dtype: torch.dtype, device: torch.device) -> NamedTensors:
        """Collective over ``name``'s tensor-parallel group; the full tensors (writer only)."""
        recipe = self.recipes[name]
        shards = gather_shards(self.weights[name].detach().to(device=device, dtype=dtype), recipe, self.mapper)  # cast first: less to move
        if self.writer_of[name] != rank():
            return []
        fulls = self.mapper.to_full(recipe, shards)
        return [(key, full.contiguous()) for key, full in zip(recipe.hf_keys, fulls)]


def _writer_rank(recipe: Recipe, mapper: ParamMapper) -> int | None:
    """The global rank that writes this rank's parameter made by ``recipe``: this rank or
    the first rank of its tensor-parallel group, or ``None`` when this rank's replica does
    not write it (data-parallel rank > 0)."""
    _, size = mapper._tp(recipe)
    if size == 1:
        return rank() if is_writer(recipe) else None
    replica_writes = (ps.get_expert_data_parallel_rank() if recipe.expert else ps.get_data_parallel_rank()) == 0
    if not replica_writes:
        return None
    group = ps.get_expert_tensor_parallel_group() if recipe.expert else ps.get_tensor_model_parallel_group()
    return dist.get_process_group_ranks(group)[0]


class HFWeights:
    """A (sharded) megatron model's weights under HF names: the
    :class:`moe_rl.rollout.weight_sync.WeightSource` the rollout engine is synced from.
    Every method is collective."""

    def __init__(self, model: GPTModel, hf_config: PretrainedConfig) -> None:
        self.model, self.hf_config = model, hf_config
        self._streamer: WeightStreamer | None = None  # its plan is made once, on first use

    @property
    def streamer(self) -> WeightStreamer:
        if self._streamer is None:
            self._streamer = WeightStreamer(self.model, self.hf_config)
        return self._streamer

    def send_buckets(self, bucket_bytes: int, dtype: torch.dtype | None, consume: BucketConsumer | None) -> int:
        return self.streamer.send_buckets(bucket_bytes, dtype, consume)

    def gather(self) -> dict[str, torch.Tensor] | None:
        """Every full tensor on the first rank (the whole model: for an engine in this process)."""
        merged: dict[str, torch.Tensor] = {}
        self.send_buckets(sys.maxsize, None, merged.update)
        return merged if rank() == self.streamer.dst else None

    def export(self, path: str | os.PathLike) -> Path:
        return export_hf_weights(self.model, self.hf_config, path)
