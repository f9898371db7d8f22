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


def _valid() -> list[bool]:
    """Rank 0: groups of 4, 3, 1 valid; rank 1: none valid (a rank may hold no statistics)."""
    return [True] * 4 + [True, False, True, True] + [False, True, False, False] + [False] * (3 * GROUP)


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        shard = _rewards().chunk(WORLD)[rank]  # whole groups on each rank
        group, weights = dist.group.WORLD, [1.0, 0.5]
        out[rank] = compute_advantages("gdpo", shard, GROUP, weights=weights, process_group=group)
        valid = _valid()[rank * len(shard) : (rank + 1) * len(shard)]
        out[("masked", rank)] = compute_advantages(
            "gdpo", shard, GROUP, weights=weights, process_group=group, valid=valid
        )
        out[("none valid", rank)] = compute_advantages(
            "gdpo", shard, GROUP, weights=weights, process_group=group, valid=[False] * len(shard)
        )
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
        distributed, masked, none_valid = (
            torch.cat([out[(kind, r) if kind else r] for r in range(WORLD)]) for kind in (None, "masked", "none valid")
        )
    single = compute_advantages("gdpo", _rewards(), GROUP, weights=[1.0, 0.5])
    torch.testing.assert_close(distributed, single, rtol=1e-9, atol=1e-9)
    # over a validity mask (groups of unequal sizes, one rank with no valid sample)
    single_masked = compute_advantages("gdpo", _rewards(), GROUP, weights=[1.0, 0.5], valid=_valid())
    torch.testing.assert_close(masked, single_masked, rtol=1e-9, atol=1e-9)
    valid = torch.tensor(_valid())
    assert masked[:8][valid[:8]].abs().min() > 0 and not masked[~valid].any()  # (the lone valid sample: 0)
    assert not none_valid.any()
    # and it differs from normalising each rank's half alone
    local = torch.cat([compute_advantages("gdpo", s, GROUP, weights=[1.0, 0.5]) for s in _rewards().chunk(WORLD)])
    assert not torch.allclose(local, single)
