"""A sharded megatron model's weights streamed in buckets of HF tensors.

Every rank computes the same plan: each parameter's full HF tensors (names, shapes) and
the rank that writes them (one per pipeline stage, one per expert-parallel rank for
experts: :func:`moe_rl.models.hf_weights.is_writer`), grouped by pipeline stage, then cut
into buckets of at most ``bucket_bytes`` that never span two stages. Each bucket is packed
into one flat byte buffer on its *sender*: the first rank, or (``per_stage``) its stage's
first rank, so that a pipeline stage's weights leave from the node that holds them instead
of crossing the network to the first rank first. Per bucket, the writers'
tensor-parallel groups gather their shards, each writer converts them to HF tensors and
sends them to the sender point to point, straight into their place in the buffer; the
sender hands the buffer to a consumer (a broadcast to the servers) and drops it. So no
rank holds more than one bucket of full tensors (plus, for a parameter split over
tensor-parallel ranks, its gathered copy; one that is not is cast as it is copied in),
whatever the model's size; only the writers' tensor-parallel groups take part (other
data-parallel replicas just wait).

Within a bucket, tensors are packed largest element size first, so each starts at a byte
offset that is a multiple of its element size (SGLang's ``FlattenedTensorBucket`` refuses
anything else; it adds no padding).

Every rank runs the same sequence of collectives in the same order, so it cannot deadlock.
Tensors travel on each rank's device (``cuda:<local rank>`` under NCCL, CPU under gloo).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from transformers import PretrainedConfig

from moe_rl.models.builder import named_weights
from moe_rl.models.hf_weights import ParamMapper, Recipe, export_hf_weights, gather_shards, is_writer, served_dtype
from parallel.collectives import all_gather_objects, rank, rank_device, recv_tensors, send_tensors, world_size

NamedTensors = list[tuple[str, torch.Tensor]]
BucketConsumer = Callable[[NamedTensors], None]
PackedConsumer = Callable[["Bucket", "torch.Tensor | None"], None]


@dataclass(frozen=True)
class WeightEntry:
    """One megatron parameter's full HF tensors, written by global rank ``writer``."""

    writer: int
    param: str  # its name on the writer and on the writer's tensor-parallel peers
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # (HF name, full shape)
    dtype: torch.dtype  # the parameter's own
    stage: int = 0  # the writer's pipeline stage

    def numel(self) -> int:
        return sum(int(torch.Size(shape).numel()) for _, shape in self.tensors)

    def sent_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """What it is sent in when the sync's dtype is ``dtype`` (expert biases keep fp32)."""
        return served_dtype(self.param, self.dtype, dtype)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Its size sent in a sync of ``dtype`` (default: its own)."""
        return self.numel() * torch.empty((), dtype=self.sent_dtype(dtype)).element_size()


@dataclass(frozen=True)
class PackedTensor:
    """One HF tensor's place in its bucket's flat byte buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # byte offset, a multiple of the element size

    @property
    def end(self) -> int:
        return self.start + int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """One bucket as every rank knows it: the rank that packs it (``sender``), its pipeline
    stage, its parameters and their HF tensors in packed order."""

    sender: int
    stage: int
    entries: tuple[WeightEntry, ...]
    tensors: tuple[PackedTensor, ...]

    @property
    def nbytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    def unpack(self, flat: torch.Tensor) -> NamedTensors:
        """``(name, tensor)`` views of ``flat`` (the packed buffer), in packed order."""
        return [(t.name, flat[t.start : t.end].view(t.dtype).view(t.shape)) for t in self.tensors]


def plan_buckets(
    entries: list[WeightEntry], bucket_bytes: int, dtype: torch.dtype | None, senders: Sequence[int] | None = None
) -> list[Bucket]:
    """``entries`` grouped by pipeline stage (in order otherwise), cut into buckets of at most
    ``bucket_bytes`` sent in ``dtype`` (default: each entry's own; an entry larger than that
    is a bucket of its own) that never span two stages; ``senders[stage]`` packs a stage's
    buckets (``None``: rank 0 packs them all). In a bucket, the largest element size first."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size {bucket_bytes} bytes must be >= 1")
    cuts: list[list[WeightEntry]] = []
    size = 0
    for entry in sorted(entries, key=lambda e: e.stage):  # stable: rank order within a stage
        nbytes = entry.nbytes(dtype)
        if not cuts or size + nbytes > bucket_bytes or cuts[-1][0].stage != entry.stage:
            cuts.append([])
            size = 0
        cuts[-1].append(entry)
        size += nbytes
    return [_packed(cut, dtype, 0 if senders is None else senders[cut[0].stage]) for cut in cuts]


def _packed(entries: list[WeightEntry], dtype: torch.dtype | None, sender: int) -> Bucket:
    ordered = sorted(entries, key=lambda e: -e.sent_dtype(dtype).itemsize)  # stable
    tensors, offset = [], 0
    for entry in ordered:
        sent = entry.sent_dtype(dtype)
        for name, shape in entry.tensors:
            tensors.append(PackedTensor(name, shape, sent, offset))
            offset = tensors[-1].end
    return Bucket(sender, ordered[0].stage, tuple(ordered), tuple(tensors))


class WeightStreamer:
    """Streams ``model``'s weights as HF tensors in packed buckets (see the module doc)."""

    def __init__(self, model: GPTModel, hf_config: PretrainedConfig, *, dst: int = 0) -> None:
        self.model = model
        self.mapper = ParamMapper(hf_config, model)
        self.dst = dst
        tied = self.mapper.tied
        # each weight's module and attribute, read afresh at every sync (a buffer may be
        # replaced); a walk of every module per sync cost more than the sync's copies
        self._owners = [
            (name, *_owner(model, name))
            for name, _ in named_weights(model)
            if not (name == "output_layer.weight" and tied)
        ]
        self.weights = self._current_weights()
        self.recipes = {name: self.mapper.recipe(name) for name in self.weights}
        self.writer_of = {name: _writer_rank(recipe, self.mapper) for name, recipe in self.recipes.items()}
        self.entries, self.stage_senders = self._global_plan()  # collective, once
        self._plans: dict[tuple[int, torch.dtype | None, bool], list[Bucket]] = {}  # plan() per its arguments

    def _current_weights(self) -> dict[str, torch.Tensor]:
        """The weights (parameters, expert biases) as their modules hold them now."""
        return {name: getattr(module, attribute) for name, module, attribute in self._owners}

    def _global_plan(self) -> tuple[list[WeightEntry], list[int]]:
        """Every rank's entries, and each pipeline stage's first global rank (its sender:
        data-parallel and tensor-parallel rank 0 of the stage, a writer of every gathered
        tensor of its stage's first replica)."""
        me, stage = rank(), ps.get_pipeline_model_parallel_rank()
        mine = [
            WeightEntry(me, name, self._full_shapes(name), self.weights[name].dtype, stage)
            for name in self.weights
            if self.writer_of[name] == me
        ]
        every = all_gather_objects((stage, mine))
        senders: dict[int, int] = {}
        for r, (s, _) in enumerate(every):
            senders.setdefault(s, r)
        return [entry for _, rank_entries in every for entry in rank_entries], [senders[s] for s in sorted(senders)]

    def _full_shapes(self, name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        recipe = self.recipes[name]
        _, size = self.mapper._tp(recipe)
        shards = [torch.empty(self.weights[name].shape, device="meta") for _ in range(size)]
        return tuple((key, tuple(full.shape)) for key, full in zip(recipe.hf_keys, self.mapper.to_full(recipe, shards)))

    def total_bytes(self, dtype: torch.dtype) -> int:
        return sum(entry.nbytes(dtype) for entry in self.entries)

    def plan(self, bucket_bytes: int, dtype: torch.dtype | None, *, per_stage: bool = False) -> list[Bucket]:
        """The buckets :meth:`stream` sends (the same on every rank; no communication).
        Planned once per arguments: the entries are fixed when the streamer is made (a
        sync into an in-process engine every step re-planned its ~0.8 ms each time)."""
        key = (bucket_bytes, dtype, per_stage)
        if key not in self._plans:
            senders = self.stage_senders if per_stage else [self.dst] * len(self.stage_senders)
            self._plans[key] = plan_buckets(self.entries, bucket_bytes, dtype, senders)
        return list(self._plans[key])

    @torch.no_grad()
    def stream(
        self,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        consume: PackedConsumer | None,
        *,
        per_stage: bool = False,
        every_rank: bool = False,
    ) -> list[Bucket]:
        """Collective: each bucket packed on its sender (``dst``; ``per_stage``: its stage's
        first rank), which calls ``consume(bucket, flat)`` with the packed bytes (on its
        device, tensors in ``dtype`` or the parameters' own) and drops them before packing
        its next one; ``dst`` also calls ``consume(bucket, None)``, in order, for each bucket
        another rank sends (``every_rank``: every rank given a ``consume`` does, after each
        bucket is packed, so that a consumer may run collectives of its own). Returns the
        plan. (A callback, not a generator: a suspended generator keeps its last bucket
        alive while it packs the next, doubling the peak.)"""
        self.weights = self._current_weights()  # a buffer may have been replaced since
        plan = self.plan(bucket_bytes, dtype, per_stage=per_stage)
        for bucket in plan:
            flat = self._pack(bucket)
            if consume is not None and (flat is not None or rank() == self.dst or every_rank):
                consume(bucket, flat)
            del flat
        return plan

    def send_buckets(self, bucket_bytes: int, dtype: torch.dtype | None, consume: BucketConsumer | None) -> int:
        """Collective: ``consume(bucket)`` on ``dst`` for each bucket of ``(HF name, tensor)``
        pairs (views of its packed bytes); returns the number of buckets."""
        unpack = None if consume is None else (lambda bucket, flat: consume(bucket.unpack(flat)))
        return len(self.stream(bucket_bytes, dtype, unpack))

    def _pack(self, bucket: Bucket) -> torch.Tensor | None:
        """Collective over the bucket's writers: its packed bytes on its sender, ``None`` elsewhere."""
        me, device = rank(), rank_device()
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device) if me == bucket.sender else None
        places = bucket.unpack(flat) if flat is not None else []
        first = 0
        for entry in bucket.entries:
            dtype = bucket.tensors[first].dtype
            mine = places[first : first + len(entry.tensors)]
            first += len(entry.tensors)
            if self.writer_of.get(entry.param) == entry.writer:  # this rank holds a shard of it
                full = self._gather_full(entry.param, dtype, device, into_place=me == bucket.sender)
                if me == bucket.sender:
                    for (_, place), (_, tensor) in zip(mine, full, strict=True):
                        place.copy_(tensor)
                elif me == entry.writer:
                    send_tensors([tensor for _, tensor in full], bucket.sender)
            elif me == bucket.sender:
                recv_tensors([place for _, place in mine], entry.writer)
        return flat

    def _gather_full(self, name: str, dtype: torch.dtype, device: torch.device, *, into_place: bool) -> NamedTensors:
        """Collective over ``name``'s tensor-parallel group; the full tensors (writer only), in
        ``dtype`` and contiguous to be sent, or (``into_place``: copied into the bucket, which
        casts) views of the parameter itself where it needs no gathering."""
        recipe = self.recipes[name]
        weight = self.weights[name].detach()
        if not into_place or self.mapper._tp(recipe)[1] > 1:
            weight = weight.to(device=device, dtype=dtype)  # cast first: less to move
        shards = gather_shards(weight, recipe, self.mapper)
        if self.writer_of[name] != rank():
            return []
        fulls = self.mapper.to_full(recipe, shards)
        return [(key, full if into_place else full.contiguous()) for key, full in zip(recipe.hf_keys, fulls)]


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module that holds the weight called ``name`` in ``model``, and its attribute."""
    path, _, attribute = name.rpartition(".")
    return model.get_submodule(path), attribute


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
    :class:`moe_rl.rollout.weight_sync.base.WeightSource` the rollout engine is synced from.
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

    def stream(
        self,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        consume: PackedConsumer | None,
        *,
        per_stage: bool = False,
        every_rank: bool = False,
    ) -> list[Bucket]:
        return self.streamer.stream(bucket_bytes, dtype, consume, per_stage=per_stage, every_rank=every_rank)

    def plan(self, bucket_bytes: int, dtype: torch.dtype | None, *, per_stage: bool = False) -> list[Bucket]:
        return self.streamer.plan(bucket_bytes, dtype, per_stage=per_stage)

    def gather(self) -> dict[str, torch.Tensor] | None:
        """Every full tensor on the first rank (the whole model: for an engine in this process).
        In a single process, views of the weights themselves (nothing to gather: packing
        them into a bucket first copied the whole model once more each sync)."""
        merged: dict[str, torch.Tensor] = {}
        if world_size() == 1:  # no shards to gather: each recipe's views of the weight
            streamer = self.streamer
            streamer.weights = streamer._current_weights()
            for name, weight in streamer.weights.items():
                recipe = streamer.recipes[name]
                merged.update(zip(recipe.hf_keys, streamer.mapper.to_full(recipe, [weight.detach()])))
            return merged
        self.send_buckets(sys.maxsize, None, merged.update)
        return merged if rank() == self.streamer.dst else None

    def export(self, path: str | os.PathLike) -> Path:
        return export_hf_weights(self.model, self.hf_config, path)
