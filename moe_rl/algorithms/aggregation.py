"""Reducing per-token values ``[B, T]`` to one scalar, exactly across micro-batches.

Pass the *global* ``num_tokens`` (token-mean) or ``num_seqs`` (seq-mean-*) of the whole
batch (all micro-batches and data-parallel ranks) and the micro-batch losses sum to the
full-batch loss; leave them ``None`` to normalise by this tensor's own counts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
Count = int | float | Tensor | None


def aggregate(
    values: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
) -> Tensor:
    """``values`` masked and reduced by ``agg``, in at least fp32; an all-padding batch gives 0."""
    values = at_least_fp32(values)
    m = mask.to(values.dtype)
    if agg == "token-mean":
        denom = m.sum() if num_tokens is None else num_tokens
        return _masked(values, m).sum() / _at_least_one(denom, values)
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGG_MODES)}")
    per_seq = _masked(values, m).sum(-1)
    seq_len = m.sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / seq_len.clamp(min=1)
    denom = (seq_len > 0).sum() if num_seqs is None else num_seqs
    return per_seq.sum() / _at_least_one(denom, values)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is set (0 when nothing is), in at least fp32."""
    values = at_least_fp32(values)
    m = mask.to(values.dtype)
    return _masked(values, m).sum() / m.sum().clamp(min=1)


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row masked mean ``[B]`` (0 for rows without tokens), in at least fp32."""
    values = at_least_fp32(values)
    m = mask.to(values.dtype)
    return _masked(values, m).sum(-1) / m.sum(-1).clamp(min=1)


def masked_min_max(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Min and max of ``values`` where ``mask`` is set (+inf, -inf when nothing is: no
    value, so that a micro-batch without tokens leaves a step's extremes alone); no host sync."""
    keep, v = mask.bool(), values.detach()
    return v.masked_fill(~keep, math.inf).amin(), v.masked_fill(~keep, -math.inf).amax()


def _masked(values: Tensor, m: Tensor) -> Tensor:
    """``values * m`` with masked-out positions 0 whatever they hold (``inf * 0`` is NaN:
    a padding position's -inf log-prob would otherwise poison the sum and its gradient)."""
    return torch.where(m != 0, values, torch.zeros((), dtype=values.dtype, device=values.device)) * m


def at_least_fp32(values: Tensor) -> Tensor:
    """``values`` in fp32 if they are in a narrower float (bf16 counts 257 tokens as 256)."""
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def _at_least_one(denom: int | float | Tensor, like: Tensor) -> Tensor | float:
    """``denom``, at least 1; a host number stays one (a device copy of it would sync the stream)."""
    if isinstance(denom, Tensor):
        return denom.to(like.dtype).clamp(min=1)
    return max(float(denom), 1.0)
