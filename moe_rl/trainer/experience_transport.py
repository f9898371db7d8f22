"""The first rank's experience, sent to each rank as only the share it trains on.

Every rank gets the step's totals (lengths, token counts: small) and plans its own
micro-batches from them; the first rank then sends each rank exactly the samples its plan
names, packed into a few tensors (token ids, log-probs, advantages, routed experts in the
type the engine kept them in: :func:`moe_rl.routing.encoding.expert_index_dtype`) point to
point on the ranks' devices.
Nothing large is pickled, and no rank receives another replica's samples (tensor- and
pipeline-parallel peers of one replica each receive the same share).
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Iterable, Sequence

import numpy as np
import torch

from moe_rl.rollout.types import Sample
from moe_rl.experience.types import Experience
from moe_rl.trainer.packing import MicroBatchPlanner
from parallel.collectives import (
    broadcast_object,
    gather_objects,
    rank,
    rank_device,
    recv_tensors,
    send_tensors_to,
    world_size,
)

_ROUTING_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def share_experience(
    exp: Experience | None, scalars: dict | None, planner: MicroBatchPlanner
) -> tuple[Experience, dict]:
    """Collective. On the first rank ``exp`` is the whole step (returned as is); every
    other rank gets an :class:`Experience` holding its share, and every rank the scalars."""
    shared = broadcast_object((exp.step_totals, exp.reward_names, scalars) if exp is not None else None)
    assert shared is not None  # (the first rank's)
    totals, names, scalars = shared
    assert scalars is not None
    if world_size() == 1:
        assert exp is not None
        return exp, scalars
    needed = sorted({i for rows in planner.plan(totals.lengths) for i in rows if i is not None})
    wanted = gather_objects(needed)  # small: sample indices
    if rank() == 0:
        assert exp is not None and wanted is not None
        _send_shares(exp, {dst: indices for dst, indices in enumerate(wanted) if dst != 0 and indices})
        return exp, scalars
    samples: list[Sample | None] = [None] * len(totals.lengths)
    advantages = torch.zeros(len(totals.lengths))
    received, received_advantages = _recv_samples(len(needed), src=0) if needed else ([], torch.zeros(0))
    for i, sample, advantage in zip(needed, received, received_advantages.tolist()):
        samples[i], advantages[i] = sample, advantage
    return Experience(samples, torch.zeros(len(samples), len(names)), names, advantages, totals=totals), scalars


def _send_shares(exp: Experience, wanted: dict[int, list[int]]) -> None:
    """Each rank its samples: every share packed once (a replica's tensor- and pipeline-parallel
    ranks want the same one) and moved to the device once; first every rank's sizes, then
    the rest, each in one batch, so the transfers to the ranks overlap."""
    packed: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for indices in wanted.values():
        if tuple(indices) not in packed:
            packed[tuple(indices)] = _packed([exp.sample(i) for i in indices], exp.advantages[indices])
    send_tensors_to([(dst, packed[tuple(indices)][0]) for dst, indices in wanted.items()])
    send_tensors_to([(dst, packed[tuple(indices)][1]) for dst, indices in wanted.items()])


def _packed(samples: Sequence[Sample], advantages: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``samples`` as tensors on this rank's device: the sizes (the receiver allocates the
    rest from them), and the rest."""
    device = rank_device()
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    routing = torch.cat(routed) if routed else torch.zeros((0, 0, 0), dtype=torch.uint8)
    dtype_code = _ROUTING_DTYPES.index(routing.dtype)
    sizes = torch.tensor(
        [
            [len(s.prompt_ids), len(s.output_ids), -1 if s.routed_experts is None else len(s.routed_experts)]
            for s in samples
        ],
        dtype=torch.long,
    ).reshape(-1, 3)  # -1: no routing
    header = torch.tensor([*routing.shape, dtype_code], dtype=torch.long)
    ids = _flat([chain(s.prompt_ids, s.output_ids) for s in samples], np.int64)
    logprobs = _flat([s.output_logprobs for s in samples], np.float32)
    loss_mask = _flat([s.output_mask() for s in samples], np.uint8)
    # routing travels as its bytes: NCCL has no int16 (the type of > 256 experts)
    rest = (ids, logprobs, loss_mask, advantages.float(), _as_bytes(routing))
    return [t.contiguous().to(device) for t in (header, sizes)], [t.contiguous().to(device) for t in rest]


def _flat(lists: Sequence[Iterable], dtype: type) -> torch.Tensor:
    """The items of ``lists`` in one tensor (through numpy: ~3.5x a list of Python ints)."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(lists), dtype=dtype))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _recv_samples(count: int, src: int) -> tuple[list[Sample], torch.Tensor]:
    device = rank_device()

    def recv(*specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
        recv_tensors(tensors, src)
        return [tensor.cpu() for tensor in tensors]

    header_t, sizes = recv(((4,), torch.long), ((count, 3), torch.long))
    header = header_t.tolist()
    shape, routing_dtype = tuple(header[:3]), _ROUTING_DTYPES[header[3]]
    tokens, outputs = int(sizes[:, :2].sum()), int(sizes[:, 1].sum())
    ids_t, logprobs_t, loss_mask_t, advantages, routing_bytes = recv(
        ((tokens,), torch.long),
        ((outputs,), torch.float32),
        ((outputs,), torch.uint8),
        ((count,), torch.float32),
        ((math.prod(shape) * routing_dtype.itemsize,), torch.uint8),
    )
    ids, logprobs, loss_mask = ids_t.tolist(), logprobs_t.tolist(), loss_mask_t.tolist()
    routing = routing_bytes.view(routing_dtype).reshape(shape)
    samples, at_id, at_lp, at_route = [], 0, 0, 0
    for p, o, r in sizes.tolist():
        samples.append(
            Sample(
                prompt_ids=ids[at_id : at_id + p],
                output_ids=ids[at_id + p : at_id + p + o],
                output_logprobs=logprobs[at_lp : at_lp + o],
                finish_reason="",
                weight_version="",
                seed=0,
                routed_experts=routing[at_route : at_route + r] if r >= 0 else None,
                loss_mask=loss_mask[at_lp : at_lp + o],
            )
        )
        at_id, at_lp, at_route = at_id + p + o, at_lp + o, at_route + max(r, 0)
    return samples, advantages
