"""GDPO's batch normalisation across data-parallel ranks equals the single-process one."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl.algorithms import compute_advantages

WORLD = 2
GROUP = 4


def _rewards() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 3, (WORLD * 3 * GROUP, 2), generator=gen).double()


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        shard = _rewards().chunk(WORLD)[rank]  # whole groups on each rank
        out[rank] = compute_advantages("gdpo", shard, GROUP, weights=[1.0, 0.5], process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gdpo_across_ranks_equals_single_process() -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=WORLD, join=True)
        distributed = torch.cat([out[r] for r in range(WORLD)])
    single = compute_advantages("gdpo", _rewards(), GROUP, weights=[1.0, 0.5])
    torch.testing.assert_close(distributed, single, rtol=1e-9, atol=1e-9)
    # and it differs from normalising each rank's half alone
    local = torch.cat([compute_advantages("gdpo", s, GROUP, weights=[1.0, 0.5]) for s in _rewards().chunk(WORLD)])
    assert not torch.allclose(local, single)
