"""How the trainer's weights reach the rollout engine, chosen once per run.

A :class:`WeightSync` runs on every trainer rank (moving weights is collective: each rank
holds a shard); only the first rank holds the engine (``None`` elsewhere). The trainer
calls :meth:`WeightSync.push` after each step and never asks which engine it has.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import urlparse

import torch
from torch import Tensor

from moe_rl.rollout.types import RolloutEngine

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """The trainer's weights under HF checkpoint names. Every method is collective."""

    def gather(self) -> dict[str, Tensor] | None:
        """Every full tensor on the first rank; ``None`` on the others."""

    def send_buckets(self, bucket_bytes: int, dtype: torch.dtype | None, consume: Callable[[list[tuple[str, Tensor]]], None] | None) -> int:
        """``consume(bucket)`` on the first rank for each bucket of at most ``bucket_bytes``
        of full tensors (on its device); no rank holds more than a bucket at a time.
        Returns the number of buckets."""

    def export(self, path: Path) -> Path:
        """Write a HF directory at ``path`` (each rank writes what it owns)."""


class WeightSync(ABC):
    def __init__(self, engine: RolloutEngine | None) -> None:
        self.engine = engine

    @abstractmethod
    def push(self, weights: WeightSource, version: str) -> None:
        """Collective: after it returns, the engine serves ``weights`` as ``version``."""

    def close(self) -> None:
        """Release what the sync holds (a process group)."""


class InProcessSync(WeightSync):
    """Full tensors gathered to the first rank, handed to an engine in this process."""

    def push(self, weights: WeightSource, version: str) -> None:
        tensors = weights.gather()
        if self.engine is not None:
            self.engine.update_weights(tensors, version)


class DiskSync(WeightSync):
    """A HF directory every server re-reads (``/update_weights_from_disk``); ``path`` must
    be on a file system the servers see."""

    def __init__(self, engine: RolloutEngine | None, path: Path) -> None:
        super().__init__(engine)
        self.path = Path(path)

    def push(self, weights: WeightSource, version: str) -> None:
        weights.export(self.path)
        if self.engine is not None:
            self.engine.update_weights_from_disk(str(self.path.resolve()), version)


class DistributedSync(WeightSync):
    """Buckets of full tensors broadcast from the first rank to every server rank over a
    weight-update group (NCCL on GPUs, gloo on CPU) that the servers join once. Every
    trainer rank takes part in moving the buckets to the first rank (its shards); only
    the first rank talks to the servers. ``engine`` is an
    :class:`moe_rl.rollout.sglang.SGLangEngine` on the first rank, ``None`` elsewhere."""

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
    ) -> None:
        super().__init__(engine)
        self.bucket_bytes, self.dtype, self.address = bucket_bytes, dtype, address
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        self.group = None
        self.group_name = ""

    def push(self, weights: WeightSource, version: str) -> None:
        if self.engine is None:  # this rank's shards travel to the first rank
            weights.send_buckets(self.bucket_bytes, self.dtype, None)
            return
        start = time.perf_counter()
        if self.group is None:
            self.group = self._connect()

        def send(bucket) -> None:
            self.engine.update_weights_from_distributed(bucket, self._broadcast, group_name=self.group_name, weight_version=version)

        with self.engine.weight_update(version):
            count = weights.send_buckets(self.bucket_bytes, self.dtype, send)
        log.info("weights %s sent to %d server(s) in %d bucket(s) in %.2fs", version, len(self.engine.urls), count, time.perf_counter() - start)

    def _connect(self):
        from parallel.launch import free_port
        from parallel.weight_update_group import join_weight_update_group

        address = self.address or reachable_address(self.engine.urls)
        port = free_port()
        # a name of its own: servers keep a group by name, and one that an earlier trainer
        # left (a restarted or resumed run against long-lived servers) refuses the name
        self.group_name = f"{self.GROUP_PREFIX}-{uuid.uuid4().hex[:12]}"
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def join(world_size: int):  # on a thread of its own, whose current device must be this rank's
            if device is not None:
                torch.cuda.set_device(device)
            return join_weight_update_group(
                backend=self.backend, address=address, port=port, world_size=world_size, rank=0,
                group_name=self.group_name, timeout_s=self.timeout_s,
            )  # fmt: skip

        return self.engine.init_weights_update_group(address, port, self.group_name, self.backend, join)

    def _broadcast(self, named_tensors) -> None:
        for _, tensor in named_tensors:
            torch.distributed.broadcast(tensor, group=self.group, group_src=0)

    def close(self) -> None:
        from parallel.weight_update_group import leave_weight_update_group

        if self.group is not None and self.engine is not None:
            self.engine.destroy_weights_update_group(self.group_name)
        leave_weight_update_group(self.group)
        self.group = None


class TensorSync(WeightSync):
    """Buckets handed to servers on the first rank's node by reference
    (``/update_weights_from_tensor``): CUDA IPC handles of the first rank's GPU tensors,
    which every server rank copies from (over NVLink); on CPU (tests), named shared-memory
    files through torch's shared-memory manager process, which lives on while a server
    keeps its connection (and with it any pipe it inherited). Each bucket is a copy that
    stays alive until every server has replied."""

    def __init__(self, engine: RolloutEngine | None, *, bucket_bytes: int, dtype: torch.dtype) -> None:
        super().__init__(engine)
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        if engine is not None and not torch.cuda.is_available():
            from torch import multiprocessing as torch_mp

            # CPU tensors travel as named shared-memory files, which any process on the node can open
            torch_mp.set_sharing_strategy("file_system")

    def push(self, weights: WeightSource, version: str) -> None:
        if self.engine is None:
            weights.send_buckets(self.bucket_bytes, self.dtype, None)
            return

        def send(bucket) -> None:
            # a copy: a bucket tensor may be the parameter itself, whose storage sharing
            # would move (CPU: into shared memory) and a colocated trainer then offloads
            shared = [(name, tensor.clone()) for name, tensor in bucket]
            self.engine.update_weights_from_tensor(serialize_named_tensors(shared), weight_version=version)

        with self.engine.weight_update(version):
            weights.send_buckets(self.bucket_bytes, self.dtype, send)


def serialize_named_tensors(named_tensors: list[tuple[str, Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)``: base64 of
    torch's multiprocessing pickle, which carries CUDA tensors as IPC handles."""
    import base64
    from multiprocessing.reduction import ForkingPickler

    from torch import multiprocessing as _registers_tensor_reductions  # noqa: F401

    return base64.b64encode(ForkingPickler.dumps(named_tensors)).decode("utf-8")


def deserialize_named_tensors(text: str) -> list[tuple[str, Tensor]]:
    """The inverse of :func:`serialize_named_tensors` (what a server rank does)."""
    import base64
    from multiprocessing.reduction import ForkingPickler

    from torch import multiprocessing as _registers_tensor_reductions  # noqa: F401

    return ForkingPickler.loads(base64.b64decode(text))


def reachable_address(urls: list[str]) -> str:
    """This host's address as the servers at ``urls`` reach it: loopback when they are all
    local, else the address of the interface that routes to the first one (no packet is sent)."""
    hosts = [urlparse(u).hostname or "127.0.0.1" for u in urls]
    if all(h in ("127.0.0.1", "localhost", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((hosts[0], urlparse(urls[0]).port or 80))
        return probe.getsockname()[0]
