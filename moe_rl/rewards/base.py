"""Reward functions by name: the registry, the types a reward sees and returns, and what
turns a call's value into a score (the scorer is :mod:`moe_rl.rewards.scorer`).

A reward function maps one :class:`RewardInput` to a float; one that raises, runs past
its timeout or returns NaN/Inf scores 0 for that sample.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from moe_rl.algorithms.registry import Registry

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
FAILURE_KINDS = ("error", "timeout", "nonfinite")


@dataclass(frozen=True)
class RewardInput:
    """One sampled response and what a rule reward may need to score it."""

    prompt: str
    response: str
    answer: str | None = None
    num_response_tokens: int | None = None
    max_response_tokens: int | None = None  # the sampling limit (rollout.max_new_tokens)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardSpec:
    """One reward column: its ``name``, the function (a registered name or
    ``"package.module:function"``), its GDPO/sum ``weight`` and keyword arguments."""

    name: str
    fn: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConditionalSpec:
    """Reward ``target`` counts only where reward ``condition`` is ``>= threshold``."""

    target: str
    condition: str
    threshold: float = 1.0


@dataclass
class RewardBatch:
    """Scores ``[B, n_rewards]`` with column ``names`` and failure counts of this batch."""

    values: Tensor
    names: list[str]
    weights: list[float]
    failures: dict[str, Counter] = field(default_factory=dict)

    def column(self, name: str) -> Tensor:
        return self.values[:, self.names.index(name)]

    def total(self) -> Tensor:
        """Weighted sum of the columns ``[B]``."""
        return self.values @ torch.tensor(self.weights, dtype=self.values.dtype)

    @classmethod
    def concat(cls, batches: Sequence[RewardBatch]) -> RewardBatch:
        """The rows of ``batches`` (same columns) one after another, failures summed."""
        failures = {n: sum((b.failures.get(n, Counter()) for b in batches), Counter()) for n in batches[0].names}
        return cls(torch.cat([b.values for b in batches]), list(batches[0].names), list(batches[0].weights), failures)


def resolve_reward_fn(fn: str) -> RewardFn:
    """A registered reward name, or ``"package.module:function"`` for a user function."""
    if ":" in fn:
        module_name, _, attr = fn.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import reward function {fn!r}: {e}") from None
    return REWARD_FUNCTIONS.get(fn)


def check_reward_function(fn: str, kwargs: dict[str, Any]) -> None:
    """``ValueError`` (worded to follow the name) unless ``fn`` resolves to a callable that
    takes a :class:`RewardInput` and ``kwargs``. Imports a user's module."""
    if ":" not in fn and fn not in REWARD_FUNCTIONS:
        raise ValueError(f"is unknown; valid: {', '.join(REWARD_FUNCTIONS.names())} or module:function")
    module_name, _, attr = fn.partition(":")
    try:
        func = resolve_reward_fn(fn)
    except Exception as e:  # a user's module may fail in any way while importing
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"cannot be imported (module {module_name!r}, attribute {attr!r}): {reason}") from None
    if not callable(func):
        raise ValueError("is not callable")
    try:
        inspect.signature(func).bind(None, **kwargs)
    except TypeError as e:
        raise ValueError(f"does not take kwargs {sorted(kwargs)} ({e})") from None
    except ValueError:  # no signature to inspect (a builtin)
        pass


def warm_up(fn: RewardFn) -> None:
    """Run ``fn.warm_up()`` if the function has one (lazy imports, parser tables: work its
    first calls would otherwise pay within a run's first steps); a failure is only logged."""
    hook = getattr(fn, "warm_up", None)
    if hook is None:
        return
    try:
        hook()
    except Exception as e:  # noqa: BLE001 - the real calls will report it
        log.debug("warm-up of %r failed: %r", fn, e)


def reward_outcome(value: Any) -> tuple[float, str | None]:
    """What a reward function returned, as scored: (value, None), or (0.0, "error") for a
    non-number, or (0.0, "nonfinite") for NaN/Inf."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0, "error"
    if not math.isfinite(value):
        return 0.0, "nonfinite"
    return value, None
