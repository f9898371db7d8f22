"""The typed micro-batches a rank trains on: :func:`build_train_batch` turns this rank's
data-parallel share of an :class:`~moe_rl.experience.types.Experience` into
:class:`PolicyMicroBatch` es on the rank's device (log-prob index t predicts token t+1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.algorithms.rollout_correction import Correction
from moe_rl.experience.types import Experience
from moe_rl.models.forward import MicroBatch
from moe_rl.trainer.packing import Plan, round_up


@dataclass(kw_only=True)
class PolicyMicroBatch(MicroBatch):
    """A micro-batch of the policy update. ``[b, s-1]`` fields are per log-prob position
    (position t scores token t+1); the response positions are where ``mask`` is 1."""

    mask: Tensor  # [b, s-1] float, 1 on the policy's response tokens (0 on tokens an environment inserted)
    advantages: Tensor  # [b]
    rollout_logp: Tensor  # [b, s-1] the engine's log-probs (0 off the response)
    # per sequence [len-1, layers, k] from the engine (its compact index type; None: a sample
    # it returned none for), if asked for
    routed_experts: list[Tensor | None] | None
    sample_indices: list[int]  # positions in the step's Experience (-1: an empty row)
    old_logp: Tensor | None = None  # [b, s-1] set by the old-policy pass (or the rollout's)
    ref_logp: Tensor | None = None  # [b, s-1] set by the reference pass (kl_coef > 0)
    correction: Correction | None = None  # set with old_logp under algorithm.rollout_correction
    environment_tokens: Tensor | None = None  # [b, s] 1 at input positions an environment inserted (multi-turn), if any


@dataclass
class TrainBatch:
    """This rank's share of a step, and the global counts every loss normalises by."""

    step: int  # 0-based index of the step
    micro_batches: list[PolicyMicroBatch]
    num_tokens: float  # response tokens of the whole step (all ranks)
    num_seqs: float  # responses of the whole step with at least one token
    experience: Experience = field(repr=False)
    real_tokens: float = 0.0  # prompt + response tokens of this rank's micro-batches (a host count)

    @property
    def padding(self) -> tuple[float, float]:
        """(real tokens, padded tokens) of this rank's micro-batches, from host counts (the
        lengths on the device would cost a sync per micro-batch)."""
        return self.real_tokens, float(sum(mb.input_ids.numel() for mb in self.micro_batches))


def build_train_batch(
    exp: Experience,
    step: int,
    plan: Plan,
    *,
    seq_len_multiple: int,
    pad_id: int,
    device: torch.device,
    with_routing: bool,
) -> TrainBatch:
    """This rank's micro-batches, one per entry of ``plan`` (:mod:`moe_rl.trainer.packing`:
    sample indices, ``None`` for an empty row that adds nothing to any loss or metric).
    Each micro-batch is padded to its own longest sample, rounded up to
    ``seq_len_multiple`` (micro-batches of different lengths: pipeline stages exchange
    shapes, :func:`moe_rl.models.forward.run_microbatches`). Built on the CPU and moved to
    ``device`` in one place (:func:`_on_device`)."""
    routing_shape = _routing_shape(exp) if with_routing else None
    lengths, advantages = exp.lengths, exp.advantages.tolist()
    micro_batches = []
    for rows in plan:
        longest = max((lengths[i] for i in rows if i is not None), default=0)
        seq_len = round_up(max(longest, 2), seq_len_multiple)
        batch = _micro_batch(exp, advantages, rows, seq_len, pad_id, routing_shape)
        micro_batches.append(_on_device(batch, device))
    real = float(sum(lengths[i] for rows in plan for i in rows if i is not None))
    return TrainBatch(step, micro_batches, float(exp.num_response_tokens), float(exp.num_responses), exp, real)


def _routing_shape(exp: Experience) -> tuple[int, int]:
    """(layers, k) of the engine's routing, for the empty rows' (empty) routing."""
    shape = exp.step_totals.routing_shape
    if shape is None:
        raise ValueError("routing was asked for, but the rollout engine returned no routed experts")
    return shape


def _micro_batch(
    exp: Experience, step_advantages: list[float], chunk: list[int | None], seq_len: int, pad_id: int, routing_shape
) -> PolicyMicroBatch:
    """Rows of ``chunk`` (``None``: an empty row), each tensor made at once from padded rows
    (a tensor write per row and field cost more than the rest of the step's bookkeeping);
    ``step_advantages``: every sample's, as a list (made once a step)."""
    ids, mask, rollout_logp, lengths, advantages, environment = [], [], [], [], [], []
    routed: list[Tensor | None] | None = [] if routing_shape is not None else None
    for i in chunk:
        if i is None:
            ids.append([pad_id] * seq_len)
            mask.append([0.0] * (seq_len - 1))
            rollout_logp.append([0.0] * (seq_len - 1))
            lengths.append(0)
            advantages.append(0.0)
            environment.append([0.0] * seq_len)
            if routed is not None:
                routed.append(torch.zeros((0, *routing_shape), dtype=torch.int32))
            continue
        smp = exp.sample(i)
        p, o = len(smp.prompt_ids), len(smp.output_ids)
        after = seq_len - p - o  # padding past the sequence
        ids.append(smp.prompt_ids + smp.output_ids + [pad_id] * after)
        # position t predicts token t + 1: the response's tokens are predicted at p-1 .. p+o-2
        policy = [float(m) for m in smp.output_mask()]
        mask.append([0.0] * (p - 1) + policy + [0.0] * after)
        environment.append([0.0] * p + [1.0 - m for m in policy] + [0.0] * after)
        rollout_logp.append([0.0] * (p - 1) + list(smp.output_logprobs) + [0.0] * after)
        lengths.append(p + o)
        advantages.append(step_advantages[i])
        if routed is not None:
            routed.append(smp.routed_experts)
    return PolicyMicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        lengths=torch.tensor(lengths, dtype=torch.long),
        mask=torch.tensor(mask),
        advantages=torch.tensor(advantages),
        rollout_logp=torch.tensor(rollout_logp),
        routed_experts=routed,
        sample_indices=[-1 if i is None else i for i in chunk],
        environment_tokens=torch.tensor(environment) if any(map(any, environment)) else None,
    )


def _on_device(mb: PolicyMicroBatch, device: torch.device) -> PolicyMicroBatch:
    """The one place batch tensors move to the rank's device."""
    assert mb.lengths is not None  # (every row's length is known here)
    mb.input_ids, mb.lengths, mb.mask = mb.input_ids.to(device), mb.lengths.to(device), mb.mask.to(device)
    mb.advantages, mb.rollout_logp = mb.advantages.to(device), mb.rollout_logp.to(device)
    if mb.environment_tokens is not None:
        mb.environment_tokens = mb.environment_tokens.to(device)
    if mb.routed_experts is not None:
        mb.routed_experts = [r.to(device) if r is not None else None for r in mb.routed_experts]
    return mb
