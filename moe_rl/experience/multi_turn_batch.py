"""What a step does with multi-turn samples (``rollout.generate_fn``): the failed ones (a step
with too many of them stops the run; ``rollout.failed_samples`` says how they enter their
group's advantages) and the ``rollout/multi_turn/*`` scalars.

A failed sample (``Sample.meta["failed"]``: its generate function raised, timed out or built
an unusable transcript) scores 0 in every reward and none of its tokens is trained on. Its
only effect on training is through its group's statistics: ``zero`` keeps it there with
rewards 0 (its siblings' advantages are taken against a group holding a 0), ``drop`` takes
each group's statistics over its other samples only (a group of G with f failed is a group
of G - f; one left or none: advantage 0) and gives the failed ones advantage 0.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from numbers import Real
from typing import Sequence

import torch
from torch import Tensor

from moe_rl import tags
from moe_rl.algorithms import compute_advantages
from moe_rl.rollout.multi_turn import DROPPED_ENVIRONMENT_TOKENS, FAILED, TRUNCATED
from moe_rl.rollout.types import RolloutError, Sample

log = logging.getLogger("moe_rl.train")
_WARNED: set[str] = set()  # meta keys already warned about as not numbers


def failed(samples: Sequence[Sample]) -> list[bool]:
    """Which samples' generate function failed."""
    return [FAILED in s.meta for s in samples]


def stop_if_failed(samples: Sequence[Sample], max_failed_frac: float, step: int, fn: str) -> None:
    """:class:`RolloutError` (the run stops, one line) when every sample of a round failed in
    the generate function ``fn``, or more than ``max_failed_frac`` of them; it names the first
    reason."""
    reasons = [s.meta[FAILED] for s in samples if FAILED in s.meta]
    if reasons and (len(reasons) == len(samples) or len(reasons) > max_failed_frac * len(samples)):
        raise RolloutError(
            f"step {step + 1}: {len(reasons)} of {len(samples)} samples failed in rollout.generate_fn={fn}"
            f" (rollout.max_failed_frac={max_failed_frac:g}); the first: {reasons[0]}"
        )


def group_advantages(
    name: str, values: Tensor, group_size: int, weights: Sequence[float], is_failed: Sequence[bool], mode: str
) -> Tensor:
    """The advantages of rewards ``values`` ``[B, n]``: every sample in its group's statistics
    (``mode="zero"``), or (``"drop"``) the failed ones left out of them, advantage 0."""
    if mode == "zero" or not any(is_failed):
        return compute_advantages(name, values, group_size, weights=weights)
    by_size: dict[int, list[int]] = defaultdict(list)  # samples kept per group -> their indices
    for start in range(0, len(is_failed), group_size):
        kept = [i for i in range(start, start + group_size) if not is_failed[i]]
        if kept:
            by_size[len(kept)] += kept
    out = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    if name == "gdpo":  # its batch normalisation spans every kept sample, whatever its group's size
        return _gdpo_without_failed(values, weights, by_size, out)
    for size, indices in by_size.items():
        out[indices] = compute_advantages(name, values[indices], size, weights=weights)
    return out


def _gdpo_without_failed(
    values: Tensor, weights: Sequence[float], by_size: dict[int, list[int]], out: Tensor
) -> Tensor:
    """GDPO over groups of unequal sizes: each reward normalised within its group (GRPO on
    that column), weight-summed, then normalised over every kept sample."""
    w = torch.as_tensor(weights, dtype=values.dtype, device=values.device)
    for size, indices in by_size.items():
        columns = [compute_advantages("grpo", values[indices, j], size) for j in range(values.shape[1])]
        out[indices] = torch.stack(columns, dim=1) @ w
    kept = [i for indices in by_size.values() for i in indices]
    summed = out[kept]
    if len(kept) < 2 or bool(summed.amax() == summed.amin()):
        return torch.zeros_like(out)
    out[kept] = (summed - summed.mean()) / (summed.std() + 1e-6)
    return out


def _number(sample: Sample, key: str) -> float:
    """``sample.meta[key]`` as a finite number (0 when absent); anything else counts 0, with
    one warning per key and run."""
    value = sample.meta.get(key, 0)
    if isinstance(value, Real) and math.isfinite(value):
        return float(value)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "a transcript's meta[%r]=%r is not a finite number: counted as 0 in rollout/multi_turn/*", key, value
        )
    return 0.0


def multi_turn_scalars(samples: list[Sample]) -> dict[str, float]:
    """``rollout/multi_turn/*`` over every sample generated (none for single-turn samples):
    turns, tokens of the policy and of the environment (and environment tokens dropped after
    the last turn), environment time, tool calls and failures, truncation by the turn, token
    or context limit, failed generate functions; a warning for failures and for cuts to the
    model's context."""
    if not samples or "turns" not in samples[0].meta:
        return {}
    n = len(samples)
    mean = lambda key: sum(_number(s, key) for s in samples) / n  # noqa: E731
    share = lambda why: sum(s.meta.get(TRUNCATED) == why for s in samples) / n  # noqa: E731
    _warn(samples)
    return {
        tags.multi_turn("turns_mean"): mean("turns"),
        tags.multi_turn("policy_tokens_mean"): mean("policy_tokens"),
        tags.multi_turn("environment_tokens_mean"): mean("environment_tokens"),
        tags.MULTI_TURN_DROPPED_ENVIRONMENT_TOKENS: mean(DROPPED_ENVIRONMENT_TOKENS),
        tags.multi_turn("environment_seconds_mean"): mean("environment_seconds"),
        tags.multi_turn("tool_calls_mean"): mean("tool_calls"),
        tags.multi_turn("tool_failures"): sum(_number(s, "tool_failures") for s in samples),
        tags.multi_turn("truncated_by_turns_frac"): share("turns"),
        tags.multi_turn("truncated_by_tokens_frac"): share("tokens"),
        tags.MULTI_TURN_TRUNCATED_BY_CONTEXT_FRAC: share("context"),
        tags.MULTI_TURN_FAILED_SAMPLES: float(sum(failed(samples))),
    }


def _warn(samples: list[Sample]) -> None:
    reasons = [s.meta[FAILED] for s in samples if FAILED in s.meta]
    if reasons:
        log.warning(
            "%d of %d samples' generate function failed and scored 0 (first: %s)",
            len(reasons),
            len(samples),
            reasons[0],
        )
    cut = sum(s.meta.get(TRUNCATED) == "context" for s in samples)
    if cut:
        log.warning(
            "%d of %d transcripts reached the model's context (max_position_embeddings) and were cut there",
            cut,
            len(samples),
        )
