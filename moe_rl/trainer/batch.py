"""One step's experience and the typed micro-batches a rank trains on.

:class:`Experience` is what the first rank collects (samples, rewards, advantages) and
broadcasts; :func:`build_train_batch` turns this rank's data-parallel share of it into
:class:`PolicyMicroBatch` es on the rank's device (log-prob index t predicts token t+1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.models.forward import MicroBatch
from moe_rl.rollout.types import Sample


@dataclass
class Experience:
    """Everything the first rank collected for a step, broadcast to every rank as is."""

    samples: list[Sample]  # flat, prompt-major (group members contiguous)
    rewards: Tensor  # [B, n_rewards]
    reward_names: list[str]
    advantages: Tensor  # [B]

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    @property
    def num_responses(self) -> int:
        """Samples with at least one response token."""
        return sum(1 for s in self.samples if s.output_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and response tokens of every sample."""
        return sum(len(s.prompt_ids) + len(s.output_ids) for s in self.samples)

    def padded_length(self, multiple: int) -> int:
        """The longest sample, rounded up to ``multiple`` (equal on every rank)."""
        longest = max(len(s.prompt_ids) + len(s.output_ids) for s in self.samples)
        return -(-longest // multiple) * multiple


@dataclass(kw_only=True)
class PolicyMicroBatch(MicroBatch):
    """A micro-batch of the policy update. ``[b, s-1]`` fields are per log-prob position
    (position t scores token t+1); the response positions are where ``mask`` is 1."""

    mask: Tensor  # [b, s-1] float, 1 on response tokens
    advantages: Tensor  # [b]
    rollout_logp: Tensor  # [b, s-1] the engine's log-probs (0 off the response)
    routed_experts: list[Tensor] | None  # per sequence [len-1, layers, k] from the engine, if asked for
    sample_indices: list[int]  # positions in the step's Experience
    old_logp: Tensor | None = None  # [b, s-1] set by the old-policy pass (or the rollout's)
    ref_logp: Tensor | None = None  # [b, s-1] set by the reference pass (kl_coef > 0)


@dataclass
class TrainBatch:
    """This rank's share of a step, and the global counts every loss normalises by."""

    step: int  # 0-based index of the step
    micro_batches: list[PolicyMicroBatch]
    num_tokens: float  # response tokens of the whole step (all ranks)
    num_seqs: float  # responses of the whole step with at least one token
    experience: Experience = field(repr=False)


def build_train_batch(
    exp: Experience,
    step: int,
    indices: list[int],
    *,
    micro_batch_size: int,
    seq_len_multiple: int,
    pad_id: int,
    device: torch.device,
    with_routing: bool,
) -> TrainBatch:
    """Micro-batches of the samples ``indices`` (this data-parallel rank's share), every
    one padded to the step's longest sample so that all share one shape. Built on the CPU
    and moved to ``device`` in one place (:func:`_on_device`)."""
    seq_len = exp.padded_length(seq_len_multiple)
    micro_batches = [
        _on_device(_micro_batch(exp, indices[start : start + micro_batch_size], seq_len, pad_id, with_routing), device)
        for start in range(0, len(indices), micro_batch_size)
    ]
    return TrainBatch(step, micro_batches, float(exp.num_response_tokens), float(exp.num_responses), exp)


def _micro_batch(exp: Experience, chunk: list[int], seq_len: int, pad_id: int, with_routing: bool) -> PolicyMicroBatch:
    ids = torch.full((len(chunk), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(chunk), seq_len - 1)
    rollout_logp = torch.zeros(len(chunk), seq_len - 1)
    lengths = torch.zeros(len(chunk), dtype=torch.long)
    for row, i in enumerate(chunk):
        smp = exp.samples[i]
        seq = smp.prompt_ids + smp.output_ids
        p, o = len(smp.prompt_ids), len(smp.output_ids)
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, p - 1 : p - 1 + o] = 1.0
        rollout_logp[row, p - 1 : p - 1 + o] = torch.tensor(smp.output_logprobs)
        lengths[row] = len(seq)
    return PolicyMicroBatch(
        input_ids=ids,
        lengths=lengths,
        mask=mask,
        advantages=exp.advantages[chunk].float(),
        rollout_logp=rollout_logp,
        routed_experts=[exp.samples[i].routed_experts for i in chunk] if with_routing else None,
        sample_indices=chunk,
    )


def _on_device(mb: PolicyMicroBatch, device: torch.device) -> PolicyMicroBatch:
    """The one place batch tensors move to the rank's device."""
    mb.input_ids, mb.lengths, mb.mask = mb.input_ids.to(device), mb.lengths.to(device), mb.mask.to(device)
    mb.advantages, mb.rollout_logp = mb.advantages.to(device), mb.rollout_logp.to(device)
    if mb.routed_experts is not None:
        mb.routed_experts = [r.to(device) if r is not None else None for r in mb.routed_experts]
    return mb
