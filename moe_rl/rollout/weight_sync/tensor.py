"""Weights handed to SGLang servers on the first rank's node by reference (CUDA IPC handles)."""

from __future__ import annotations

import logging
import time
import types
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from moe_rl.rollout.contracts import TensorWeightReceiver, require_capability
from moe_rl.rollout.types import RolloutEngine, RolloutError
from moe_rl.rollout.weight_sync.base import WeightSource, WeightSync
from moe_rl.rollout.weight_sync.cuda_ipc import serialize_for_sglang

if TYPE_CHECKING:
    from moe_rl.models.weight_buckets import Bucket

log = logging.getLogger(__name__)


class TensorSync(WeightSync[TensorWeightReceiver]):
    """Buckets handed to servers on the first rank's node by reference
    (``/update_weights_from_tensor``): SGLang takes one payload per server TP rank
    (``serialized_named_tensors[i]`` is what TP rank i maps), so each comes from the GPU that
    rank runs on where a trainer rank shares it (colocated): the first rank packs each bucket
    and broadcasts it to the other trainer ranks of its node that share a GPU with a server
    TP rank, each serializes its own copy (CUDA IPC handles, the device named by its UUID as
    SGLang's own serializer names it: a server rank sees other device numbers) and the first
    rank posts them, entry i from the rank on TP rank i's GPU. A TP rank on a GPU no trainer
    rank of the node uses maps the first rank's copy (over NVLink), as do all of them without
    CUDA. On CPU (tests), the payloads are named shared-memory files through torch's
    shared-memory manager process, which lives on while a server keeps its connection (and
    with it any pipe it inherited). A bucket is one flat tensor with its layout
    (``load_format="flattened_bucket"``) where every server takes that (SGLang 0.5.6 on),
    else a list of its tensors; every copy stays alive until every server has replied.

    ``server_gpus``: for each server, the GPU each of its TP ranks runs on, as
    ``CUDA_VISIBLE_DEVICES`` names them (a server this run launches with
    ``rollout.server.gpus``); ``None`` for a server: TP rank i on the node's i-th visible GPU
    (SGLang's default, ``--base-gpu-id 0``), the one local rank i trains on.
    ``trainer_gpus``: the GPU of each of the first node's ranks (default
    :func:`parallel.distributed.node_gpu_ids`; global ranks 0.. are that node's, as the
    launchers number them)."""

    def __init__(
        self,
        engine: RolloutEngine | None,
        *,
        bucket_bytes: int,
        dtype: torch.dtype,
        flattened: bool | None = None,
        server_gpus: Sequence[Sequence[str] | None] | None = None,
        trainer_gpus: Sequence[str] | None = None,
    ) -> None:
        from parallel.distributed import node_gpu_ids

        super().__init__(require_capability(engine, TensorWeightReceiver, "rollout.weight_sync.method=tensor"))
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.flattened = flattened  # None: where every server supports it (asked at the first push)
        self.server_gpus = list(server_gpus) if server_gpus is not None else None
        self.trainer_gpus = [str(g) for g in (node_gpu_ids() if trainer_gpus is None else trainer_gpus)]
        self.producers: list[list[int]] | None = None  # per server, the trainer rank serializing each TP rank's payload
        self.group: Any = None  # the first rank and the other producers (None: the first rank alone)
        if not torch.cuda.is_available():
            from torch import multiprocessing as torch_mp

            # CPU tensors travel as named shared-memory files, which any process on the node can open
            torch_mp.set_sharing_strategy("file_system")

    def payload_producers(self, tp_sizes: Sequence[int]) -> list[list[int]]:
        """For each server (of TP size ``tp_sizes[s]``), the trainer rank whose copy each TP rank
        maps: the one training on that rank's GPU, else the first rank."""
        out = []
        for s, size in enumerate(tp_sizes):
            gpus = (self.server_gpus or [None] * len(tp_sizes))[s]
            ranks = []
            for i in range(size):
                if gpus is None:
                    ranks.append(i if i < len(self.trainer_gpus) else 0)
                else:
                    gpu = str(gpus[i]) if i < len(gpus) else None
                    ranks.append(self.trainer_gpus.index(gpu) if gpu in self.trainer_gpus else 0)
            out.append(ranks)
        return out

    def _plan(self) -> None:
        """Collective, at the first push: which ranks produce payloads, in a group of their own."""
        import torch.distributed as dist

        from parallel.collectives import broadcast_object, world_size

        if self.engine is not None:
            if self.flattened is None:
                self.flattened = self.engine.supports_flattened_buckets()
            plan = (self.payload_producers(self.engine.server_ranks()), self.flattened)
        else:
            plan = None
        shared = broadcast_object(plan)
        assert shared is not None  # (the first rank's)
        self.producers, self.flattened = shared
        members = sorted({0, *(r for server in self.producers for r in server if r < world_size())})
        if len(members) > 1:
            self.group = dist.new_group(members)  # (every rank takes part in making it)
        self.members = members

    def push(self, weights: WeightSource, version: str) -> None:
        from parallel.collectives import rank

        if self.producers is None:
            self._plan()
        if rank() not in self.members:
            weights.stream(self.bucket_bytes, self.dtype, None)
            return
        start = time.perf_counter()
        if self.engine is None:  # another producer: its copy of every bucket
            weights.stream(self.bucket_bytes, self.dtype, self._send, every_rank=True)
            return
        with self.engine.weight_update(version):
            plan = weights.stream(self.bucket_bytes, self.dtype, self._send, every_rank=self.group is not None)
        log.info(
            "weights %s handed to %d server(s) in %d %s bucket(s) in %.2fs (payloads from trainer ranks %s)",
            version,
            len(self.engine.server_urls()),
            len(plan),
            "flattened" if self.flattened else "per-tensor",
            time.perf_counter() - start,
            self.members,
        )

    def _send(self, bucket: Bucket, flat: Tensor | None) -> None:
        """One bucket: the first rank's packed bytes copied to the other producers' GPUs, each
        copy serialized where it lies, every server given its TP ranks' payloads."""
        import torch.distributed as dist

        from parallel.collectives import rank, rank_device

        if self.group is not None:
            if flat is None:
                flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=rank_device())
            dist.broadcast(flat, src=0, group=self.group)
        # the packed bytes are a buffer of their own (never a parameter, whose storage
        # sharing would move: on CPU into shared memory)
        assert flat is not None  # (packed here, or received from the first rank)
        payload = flattened_bucket(bucket, flat) if self.flattened else bucket.unpack(flat)
        mine = serialize_for_sglang(payload)
        if self.group is None:
            serialized = {0: mine}
        else:
            every: list[Any] | None = [None] * len(self.members) if rank() == 0 else None
            dist.gather_object(mine, every, dst=0, group=self.group)
            serialized = dict(zip(self.members, every)) if every is not None else {}
        error = None
        if self.engine is not None:
            assert self.producers is not None  # (planned at the first push)
            try:
                self.engine.update_weights_from_tensor(
                    [[serialized[r] for r in server] for server in self.producers],
                    flattened=bool(self.flattened),
                )
            except Exception as e:  # the other producers stop with it
                error = e
        if self.group is not None:  # each copy stays alive until every server has replied
            box = [None if error is None else f"{type(error).__name__}: {error}"]
            dist.broadcast_object_list(box, src=0, group=self.group)
            if box[0] is not None and error is None:
                raise RolloutError(f"the weight update failed on the first rank: {box[0]}")
        if error is not None:
            raise error


def flattened_bucket(bucket: Bucket, flat: Tensor) -> dict:
    """A bucket as SGLang's ``load_format="flattened_bucket"`` takes it by reference:
    ``{"flattened_tensor": bytes, "metadata": [...]}``, each entry with the fields of its
    ``FlattenedTensorMetadata`` (as a ``SimpleNamespace``, which its unpickler allows; byte
    offsets, ``numel`` in bytes)."""
    metadata = [
        types.SimpleNamespace(
            name=t.name,
            shape=torch.Size(t.shape),
            dtype=t.dtype,
            start_idx=t.start,
            end_idx=t.end,
            numel=t.end - t.start,
        )
        for t in bucket.tensors
    ]
    return {"flattened_tensor": flat, "metadata": metadata}
