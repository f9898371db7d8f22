"""What a step does with multi-turn samples (``rollout.multi_turn.generate_fn``): the failed ones (a step
with too many of them stops the run) and the ``rollout/multi_turn/*`` scalars.

A failed sample (``Sample.status`` failed: its generate function raised, timed out or built
an unusable transcript) scores 0 in every reward and none of its tokens is trained on. Its
only effect on training is through its group's statistics (``rollout.multi_turn.failed_samples``:
``zero`` keeps it there with rewards 0, ``drop`` leaves it out of them; the collector hands
the valid samples to :func:`moe_rl.algorithms.compute_advantages`).
"""

from __future__ import annotations

import logging
import math
from numbers import Real
from typing import Sequence

from moe_rl import tags
from moe_rl.rollout.types import RolloutError, Sample, SampleStatus, Truncation

log = logging.getLogger("moe_rl.train")
_WARNED: set[str] = set()  # meta keys already warned about as not numbers


def failed(samples: Sequence[Sample]) -> list[bool]:
    """Which samples' generate function failed."""
    return [s.status is SampleStatus.FAILED for s in samples]


def stop_if_failed(samples: Sequence[Sample], max_failed_frac: float, step: int, fn: str) -> None:
    """:class:`RolloutError` (the run stops, one line) when every sample of a round failed in
    the generate function ``fn``, or more than ``max_failed_frac`` of them; it names the first
    reason."""
    reasons = [s.failure for s in samples if s.failure is not None]
    if reasons and (len(reasons) == len(samples) or len(reasons) > max_failed_frac * len(samples)):
        raise RolloutError(
            f"step {step + 1}: {len(reasons)} of {len(samples)} samples failed in rollout.multi_turn.generate_fn={fn}"
            f" (rollout.multi_turn.max_failed_frac={max_failed_frac:g}); the first: {reasons[0]}"
        )


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
    share = lambda why: sum(s.truncation is why for s in samples) / n  # noqa: E731
    _warn(samples)
    return {
        tags.multi_turn("turns_mean"): mean("turns"),
        tags.multi_turn("policy_tokens_mean"): mean("policy_tokens"),
        tags.multi_turn("environment_tokens_mean"): mean("environment_tokens"),
        tags.MULTI_TURN_DROPPED_ENVIRONMENT_TOKENS: sum(s.dropped_environment_tokens or 0 for s in samples) / n,
        tags.multi_turn("environment_seconds_mean"): mean("environment_seconds"),
        tags.multi_turn("tool_calls_mean"): mean("tool_calls"),
        tags.multi_turn("tool_failures"): sum(_number(s, "tool_failures") for s in samples),
        tags.multi_turn("truncated_by_turns_frac"): share(Truncation.TURNS),
        tags.multi_turn("truncated_by_tokens_frac"): share(Truncation.TOKENS),
        tags.MULTI_TURN_TRUNCATED_BY_CONTEXT_FRAC: share(Truncation.CONTEXT),
        tags.MULTI_TURN_FAILED_SAMPLES: float(sum(failed(samples))),
    }


def _warn(samples: list[Sample]) -> None:
    reasons = [s.failure for s in samples if s.failure is not None]
    if reasons:
        log.warning(
            "%d of %d samples' generate function failed and scored 0 (first: %s)",
            len(reasons),
            len(samples),
            reasons[0],
        )
    cut = sum(s.truncation is Truncation.CONTEXT for s in samples)
    if cut:
        log.warning(
            "%d of %d transcripts reached the model's context (max_position_embeddings) and were cut there",
            cut,
            len(samples),
        )
