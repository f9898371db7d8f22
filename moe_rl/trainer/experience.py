"""One step's experience: rollout samples + rewards + advantages, laid out as padded
micro-batches for the megatron schedule (log-prob index t predicts token t+1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.models.forward import MicroBatch
from moe_rl.rollout.types import Sample


@dataclass
class Experience:
    """Everything rank 0 collected for a step, broadcast to every rank as is."""

    samples: list[Sample]  # flat, prompt-major (group members contiguous)
    rewards: Tensor  # [B, n_rewards]
    reward_names: list[str]
    advantages: Tensor  # [B]
    seq_len: int  # padded length of every micro-batch

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)


def padded_length(samples: list[Sample], multiple: int) -> int:
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    return -(-longest // multiple) * multiple


def build_microbatches(exp: Experience, indices: list[int], micro_batch_size: int, pad_id: int = 0) -> list[MicroBatch]:
    """Micro-batches of the samples ``indices`` (this data-parallel rank's share).

    ``extras``: ``mask`` / ``rollout_logp`` ``[b, s-1]`` (response positions),
    ``advantages`` ``[b]``, ``lengths`` ``[b]`` and ``routed`` (engine routing per sequence).
    """
    out = []
    s = exp.seq_len
    for start in range(0, len(indices), micro_batch_size):
        chunk = indices[start : start + micro_batch_size]
        ids = torch.full((len(chunk), s), pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), s - 1)
        rollout_logp = torch.zeros(len(chunk), s - 1)
        lengths = torch.zeros(len(chunk), dtype=torch.long)
        for row, i in enumerate(chunk):
            smp = exp.samples[i]
            seq = smp.prompt_ids + smp.output_ids
            p, o = len(smp.prompt_ids), len(smp.output_ids)
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, p - 1 : p - 1 + o] = 1.0
            rollout_logp[row, p - 1 : p - 1 + o] = torch.tensor(smp.output_logprobs)
            lengths[row] = len(seq)
        extras = {
            "mask": mask,
            "rollout_logp": rollout_logp,
            "advantages": exp.advantages[chunk].float(),
            "lengths": lengths,
            "routed": [exp.samples[i].routed_experts for i in chunk],
            "sample_indices": chunk,
        }
        out.append(MicroBatch(ids, extras=extras))
    return out
