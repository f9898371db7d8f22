"""Weights broadcast to every SGLang server rank over weight-update groups the servers join."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlparse

import torch
from torch import Tensor

from moe_rl.rollout.contracts import DistributedWeightReceiver, require_capability
from moe_rl.rollout.types import RolloutEngine, RolloutError
from moe_rl.rollout.weight_sync.base import WeightSource, WeightSync
from moe_rl.rollout.weight_sync.nccl import check_nccl_versions, trainer_nccl_version

if TYPE_CHECKING:
    from moe_rl.models.weight_buckets import Bucket

log = logging.getLogger(__name__)


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
        super().__init__(
            require_capability(engine, DistributedWeightReceiver, "rollout.weight_sync.method=distributed")
        )
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
                socket.gethostname(),
            )
        shared = broadcast_object(setup)
        assert shared is not None  # (the first rank's)
        urls, token, flattened, world_size, first_host = shared
        me = rank()
        endpoint = None
        if me in senders:
            on_first_host = socket.gethostname() == first_host
            address = self.address if me == 0 and self.address else reachable_address(urls, on_first_host)
            endpoint = (address, free_port())
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


def reachable_address(urls: Sequence[str], on_first_host: bool = True) -> str:
    """This host's address as the servers at ``urls`` reach it: the address of the interface
    that routes to the first of them (no packet is sent); loopback when they are all local
    to the first rank's host and this is that host. Loopback URLs on another host (a later
    pipeline stage's sender on another node) name the first rank's host: the interface that
    routes to it (``MASTER_ADDR``, the launcher's address of the first rank)."""
    hosts = [urlparse(u).hostname or "127.0.0.1" for u in urls]
    if not all(h in LOOPBACK for h in hosts):
        return _interface_towards(hosts[0], urlparse(urls[0]).port or 80)
    if on_first_host:
        return "127.0.0.1"
    from parallel.distributed import launch_env

    first_rank = launch_env()
    if first_rank.master_addr in LOOPBACK:
        raise RolloutError(
            f"servers at {', '.join(urls)} run on the first rank's host, but this sender is on "
            f"{socket.gethostname()} and MASTER_ADDR={first_rank.master_addr} does not say where that host is: "
            "give rollout.server.urls with the host's name"
        )
    return _interface_towards(first_rank.master_addr, first_rank.master_port)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _interface_towards(host: str, port: int) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]
