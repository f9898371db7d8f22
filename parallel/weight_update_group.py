"""A process group outside the trainer's world, for sending weights to inference servers.

SGLang's ``/init_weights_update_group`` makes each server rank join a group by TCP
rendezvous at ``tcp://address:port`` under ``group_name``, as rank ``rank_offset + tp_rank``;
the trainer's sender joins it as rank 0 (and so hosts the rendezvous store). Both sides
must build the group the same way, the way ``torch.distributed.init_process_group`` builds
the default one (rendezvous store, prefixed by the group name), but without touching the
default group. Collectives on the returned group use group ranks (``group_src=0``).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def join_weight_update_group(
    *,
    backend: str,
    address: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group ``group_name``; blocks until all ``world_size`` ranks joined."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a weight-update group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=c10d.GroupName(group_name), timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_weight_update_group(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group`` (safe on ``None``)."""
    if group is not None:
        dist.destroy_process_group(group)


def abort_weight_update_group(group: dist.ProcessGroup | None) -> None:
    """Abort ``group`` (safe on ``None``): a collective another thread waits in (for a peer
    that will not enter it) fails instead of lasting until the group's timeout, and the
    process can exit (a gloo group destroyed under a waiting collective aborts it at exit)."""
    if group is not None:
        c10d._abort_process_group(group)
