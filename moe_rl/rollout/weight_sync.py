"""How the trainer's weights reach the rollout engine, chosen once per run.

A :class:`WeightSync` runs on every trainer rank (moving weights is collective: each rank
holds a shard); only the first rank holds the engine (``None`` elsewhere). The trainer
calls :meth:`WeightSync.push` after each step and never asks which engine it has.
"""

from __future__ import annotations

import logging
import pickle
import socket
import time
import types
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, Sequence, TypeVar
from urllib.parse import urlparse

import torch
from torch import Tensor

from moe_rl.rollout.contracts import (
    DistributedWeightReceiver,
    InProcessWeightReceiver,
    TensorWeightReceiver,
    require_capability,
)
from moe_rl.rollout.types import RolloutEngine, RolloutError

if TYPE_CHECKING:
    from moe_rl.models.weight_buckets import Bucket

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """The trainer's weights under HF checkpoint names. Every method is collective."""

    def gather(self) -> dict[str, Tensor] | None:
        """Every full tensor on the first rank; ``None`` on the others."""

    def send_buckets(
        self, bucket_bytes: int, dtype: torch.dtype | None, consume: Callable[[list[tuple[str, Tensor]]], None] | None
    ) -> int:
        """``consume(bucket)`` on the first rank for each bucket of at most ``bucket_bytes``
        of full tensors (on its device); no rank holds more than a bucket at a time.
        Returns the number of buckets."""

    def stream(
        self,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        consume: Callable[[Bucket, Tensor | None], None] | None,
        *,
        per_stage: bool = False,
        every_rank: bool = False,
    ) -> list[Bucket]:
        """Each bucket packed into one flat byte tensor on its sender (the first rank; with
        ``per_stage`` its pipeline stage's first rank), which calls ``consume(bucket, flat)``;
        the first rank also calls ``consume(bucket, None)`` for the buckets others send
        (``every_rank``: every rank given a ``consume``)."""

    def plan(self, bucket_bytes: int, dtype: torch.dtype | None, *, per_stage: bool = False) -> list[Bucket]:
        """The buckets :meth:`stream` sends, the same on every rank (not collective)."""

    def export(self, path: Path) -> Path:
        """Write a HF directory at ``path`` (each rank writes what it owns)."""


E = TypeVar("E")  # what a sync asks of the engine: one of rollout.contracts' capabilities


class WeightSync(ABC, Generic[E]):
    """Puts the trainer's weights into the rollout engine; ``engine`` (the first rank's,
    ``None`` elsewhere) is held as the capability the sync needs."""

    def __init__(self, engine: E | None) -> None:
        self.engine = engine

    @abstractmethod
    def push(self, weights: WeightSource, version: str) -> None:
        """Collective: after it returns, the engine serves ``weights`` as ``version``."""

    def close(self) -> None:
        """Release what the sync holds (a process group)."""


class InProcessSync(WeightSync[InProcessWeightReceiver]):
    """Full tensors gathered to the first rank, handed to an engine in this process."""

    def __init__(self, engine: RolloutEngine | None) -> None:
        super().__init__(require_capability(engine, InProcessWeightReceiver, "an in-process weight sync"))

    def push(self, weights: WeightSource, version: str) -> None:
        tensors = weights.gather()
        if self.engine is not None:
            assert tensors is not None  # (the first rank gathers them)
            self.engine.update_weights(tensors, version)


class DiskSync(WeightSync[RolloutEngine]):
    """A HF directory every server re-reads (``/update_weights_from_disk``); ``path`` must
    be on a file system the servers see."""

    def __init__(self, engine: RolloutEngine | None, path: Path) -> None:
        super().__init__(engine)
        self.path = Path(path)

    def push(self, weights: WeightSource, version: str) -> None:
        weights.export(self.path)
        if self.engine is not None:
            self.engine.update_weights_from_disk(str(self.path.resolve()), version)


@dataclass
class _SenderLink:
    """The weight-update groups of one :class:`DistributedSync`: one per sending rank (a
    pipeline stage's first rank), each with that rank as its rank 0 and every server rank."""

    group_names: dict[int, str]  # sending global rank -> its group's name
    flattened: bool  # a bucket travels as one flat broadcast (every server takes that)
    group: Any = None  # this rank's own group, when it sends


class DistributedSync(WeightSync[DistributedWeightReceiver]):
    """Buckets of full tensors broadcast to every server rank over weight-update groups
    (NCCL on GPUs, gloo on CPU) that the servers join once. SGLang receives every broadcast
    from its group's rank 0, so each sending rank (each pipeline stage's first rank: a
    stage's weights leave from where they are, not through the first rank) has a group of
    its own; the first rank alone talks to the servers and announces every bucket, whichever
    rank sends it. A bucket is one flat broadcast where every server takes that (SGLang 0.5.6
    on: ``load_format="flattened_bucket"``; ``flattened=False`` forces one per tensor), and
    every trainer rank takes part in packing the buckets (its shards). ``engine`` is an
    :class:`moe_rl.rollout.sglang.engine.SGLangEngine` on the first rank, ``None`` elsewhere."""

    GROUP_PREFIX = "moe-rl-weights"  # + a suffix of its own per connection (see _connect)

    def __init__(
        self,
        engine: RolloutEngine | None,
        *,
        bucket_bytes: int,
        dtype: torch.dtype,
        address: str = "",
        backend: str | None = None,
        timeout_s: float = 600.0,
        flattened: bool | None = None,
        per_stage: bool = True,
    ) -> None:
        super().__init__(require_capability(engine, DistributedWeightReceiver, "rollout.weight_sync=distributed"))
        self.bucket_bytes, self.dtype, self.address = bucket_bytes, dtype, address
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        self.flattened, self.per_stage = flattened, per_stage  # flattened None: where every server supports it
        self.link: _SenderLink | None = None
        self.broadcasts = 0  # broadcasts this rank sent (a count for benchmarks)

    def push(self, weights: WeightSource, version: str) -> None:
        if self.link is None:
            self.link = self._connect(weights)
        link, engine = self.link, self.engine
        if engine is None:  # a stage's sender, or a rank whose shards travel to one
            weights.stream(self.bucket_bytes, self.dtype, self._send, per_stage=self.per_stage)
            return
        start = time.perf_counter()

        def announce_and_send(bucket: Bucket, flat: Tensor | None) -> None:
            engine.update_weights_from_distributed(
                [(t.name, t.dtype, t.shape) for t in bucket.tensors],
                lambda: self._send(bucket, flat),
                group_name=link.group_names[bucket.sender],
                weight_version=version,
                flattened=link.flattened,
            )

        try:
            with engine.weight_update(version):
                plan = weights.stream(self.bucket_bytes, self.dtype, announce_and_send, per_stage=self.per_stage)
        except BaseException:
            self._abandon_link()
            raise
        log.info(
            "weights %s sent to %d server(s) in %d %s bucket(s) from %d sender(s) in %.2fs",
            version,
            len(engine.server_urls()),
            len(plan),
            "flattened" if link.flattened else "per-tensor",
            len(link.group_names),
            time.perf_counter() - start,
        )

    def _abandon_link(self) -> None:
        """After a failed push: this rank's group is aborted (its broadcast may still wait
        for a server that refused the bucket) and the link forgotten, the servers' groups
        left to them (one may be waiting in it; a new link takes new names)."""
        from parallel.weight_update_group import abort_weight_update_group

        if self.link is not None:
            abort_weight_update_group(self.link.group)
            self.link = None

    def _send(self, bucket: Bucket, flat: Tensor | None) -> None:
        """Broadcast a bucket this rank packed (nothing for one another rank sends), and wait
        until it has left: the next bucket is packed only then (bounded memory)."""
        if flat is None:
            return
        link = self.link
        assert link is not None  # (connected by push)
        for tensor in [flat] if link.flattened else [t for _, t in bucket.unpack(flat)]:
            torch.distributed.broadcast(tensor, group=link.group, group_src=0)
            self.broadcasts += 1
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()

    def _connect(self, weights: WeightSource) -> _SenderLink:
        """Collective: each sending rank (each pipeline stage's first rank with ``per_stage``,
        else the first rank) hosts a weight-update group that every server rank joins; the
        first rank asks the servers to join them one at a time (each request blocks until
        all of that group's ranks have joined)."""
        from moe_rl.rollout.sglang.weight_updates import weight_group_offsets
        from parallel.collectives import all_gather_objects, broadcast_object, rank
        from parallel.launch import free_port

        senders = sorted(
            {bucket.sender for bucket in weights.plan(self.bucket_bytes, self.dtype, per_stage=self.per_stage)}
        )
        setup = None
        if self.engine is not None:
            if self.backend == "nccl":
                check_nccl_versions(
                    trainer_nccl_version(), dict(zip(self.engine.server_urls(), self.engine.server_nccl_versions()))
                )
            flattened = self.engine.supports_flattened_buckets() if self.flattened is None else self.flattened
            # a name of its own: servers keep a group by name, and one that an earlier trainer
            # left (a restarted or resumed run against long-lived servers) refuses the name
            setup = (
                self.engine.server_urls(),
                uuid.uuid4().hex[:12],
                flattened,
                weight_group_offsets(self.engine.server_ranks())[1],
            )
        shared = broadcast_object(setup)
        assert shared is not None  # (the first rank's)
        urls, token, flattened, world_size = shared
        me = rank()
        endpoint = (
            (self.address if me == 0 and self.address else reachable_address(urls), free_port())
            if me in senders
            else None
        )
        endpoints = all_gather_objects(endpoint)
        link = _SenderLink({sender: f"{self.GROUP_PREFIX}-{token}-r{sender}" for sender in senders}, flattened)
        if self.engine is not None:
            for sender in senders:
                sender_endpoint = endpoints[sender]
                assert sender_endpoint is not None  # every sender published one
                address, port = sender_endpoint
                join = self._joiner(address, port, link.group_names[sender], hosted_here=sender == me)
                group = self.engine.init_weights_update_group(
                    address, port, link.group_names[sender], self.backend, join
                )
                link.group = group if sender == me else link.group
        elif me in senders:
            assert endpoint is not None
            address, port = endpoint
            link.group = self._join(address, port, link.group_names[me], world_size)
        return link

    def _joiner(self, address: str, port: int, name: str, *, hosted_here: bool) -> Callable[[int], Any]:
        """What the first rank runs while the servers join group ``name``: join it as its rank
        0 when it is the first rank's own (on a thread whose current device must be this
        rank's), else nothing (another rank hosts it)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def join(world_size: int):
            if not hosted_here:
                return None
            if device is not None:
                torch.cuda.set_device(device)
            return self._join(address, port, name, world_size)

        return join

    def _join(self, address: str, port: int, name: str, world_size: int):
        from parallel.weight_update_group import join_weight_update_group

        return join_weight_update_group(
            backend=self.backend,
            address=address,
            port=port,
            world_size=world_size,
            rank=0,
            group_name=name,
            timeout_s=self.timeout_s,
        )

    def close(self) -> None:
        from parallel.weight_update_group import leave_weight_update_group

        if self.link is None:
            return
        if self.engine is not None:
            for name in self.link.group_names.values():
                self.engine.destroy_weights_update_group(name)
        leave_weight_update_group(self.link.group)
        self.link = None


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
    ``rollout.server_gpus``); ``None`` for a server: TP rank i on the node's i-th visible GPU
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

        super().__init__(require_capability(engine, TensorWeightReceiver, "rollout.weight_sync=tensor"))
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
        self._version = version
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
                    weight_version=self._version,
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


def trainer_nccl_version() -> str | None:
    """The NCCL this process's torch runs (``"2.27.7"``), ``None`` without one (no CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version() if part != "")
    except (AttributeError, RuntimeError):  # a torch built without NCCL
        return None


def check_nccl_versions(trainer: str | None, servers: dict[str, str | None]) -> None:
    """A weight-update group over NCCL needs one NCCL version on every rank (NCCL refuses a
    peer of another: "Mismatched NCCL version detected"): a :class:`RolloutError` naming
    both and the fix where a server's differs; a warning for those whose version is unknown."""
    unknown = [url for url, version in servers.items() if version is None]
    if unknown:
        log.warning(
            "cannot check the NCCL version of SGLang server(s) %s (SGLang does not report it; moe-rl asks the servers "
            "it starts): they must run NCCL %s, the trainer's, or the first weight update fails",
            unknown,
            trainer or "(unknown)",
        )
    for url, version in servers.items():
        if version is not None and version != trainer:
            raise RolloutError(
                f"the trainer runs NCCL {trainer or '(none)'} and the SGLang server {url} NCCL {version or '(none)'}: a "
                "weight-update group needs one NCCL on both sides (install both on one torch: bash tools/setup.sh "
                "--sglang, docs/weight-sync.md), or use rollout.weight_sync=disk"
            )


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


_DEVICE_ARG = 6  # where torch's CUDA tensor reduction puts the device index (what SGLang's patch replaces)


def _reduce_tensor_by_uuid(tensor: Tensor):
    """torch's multiprocessing reduction of ``tensor``, a CUDA tensor's device named by its
    UUID (SGLang's patched reductions do the same: a server rank that sees other device
    numbers still maps the right GPU; its ``rebuild_cuda_tensor`` takes a UUID or an index)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = (
            *args[:_DEVICE_ARG],
            str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
            *args[_DEVICE_ARG + 1 :],
        )
    return rebuild, args


def serialize_for_sglang(obj: object) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` with its patched
    torch reductions: base64 of torch's multiprocessing pickle (CUDA tensors as IPC handles
    whose device is named by UUID, CPU tensors as shared memory), without SGLang installed
    and without changing torch's reductions for the rest of this process."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    from torch import multiprocessing as _registers_tensor_reductions  # noqa: F401

    class UuidPickler(ForkingPickler):
        _extra_reducers = {
            **ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
            torch.Tensor: _reduce_tensor_by_uuid,
            torch.nn.Parameter: _reduce_tensor_by_uuid,
        }

    buffer = io.BytesIO()
    UuidPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def deserialize_sglang_payload(text: str) -> Any:
    """The inverse of :func:`serialize_for_sglang` (what a server rank does): a CUDA
    tensor's device UUID mapped to this process's index for that GPU."""
    import base64
    import io

    from torch import multiprocessing as _registers_tensor_reductions  # noqa: F401

    class UuidUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return _rebuild_cuda_tensor_by_uuid
            return super().find_class(module, name)

    return UuidUnpickler(io.BytesIO(base64.b64decode(text))).load()


def _rebuild_cuda_tensor_by_uuid(*args):
    from torch.multiprocessing import reductions

    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        matches = [
            i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not matches:
            raise RuntimeError(f"no GPU with UUID {device} is visible to this process")
        args = (*args[:_DEVICE_ARG], matches[0], *args[_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


def reachable_address(urls: Sequence[str]) -> str:
    """This host's address as the servers at ``urls`` reach it: loopback when they are all
    local, else the address of the interface that routes to the first one (no packet is sent)."""
    hosts = [urlparse(u).hostname or "127.0.0.1" for u in urls]
    if all(h in ("127.0.0.1", "localhost", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((hosts[0], urlparse(urls[0]).port or 80))
        return probe.getsockname()[0]
