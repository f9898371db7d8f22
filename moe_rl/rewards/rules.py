"""Rule rewards for verifiable tasks: math correctness (math-verify), format, length, and
DAPO's soft overlong penalty."""

from __future__ import annotations

import re
from functools import lru_cache

from moe_rl.rewards.base import REWARD_FUNCTIONS, RewardInput

DEFAULT_FORMAT_PATTERN = r"\\boxed\{.+\}"


@REWARD_FUNCTIONS.register("math_correct")
def math_correct(sample: RewardInput) -> float:
    """1.0 if the response's final answer equals ``sample.answer`` mathematically
    (math-verify: LaTeX and plain expressions, ``\\boxed{}`` preferred), else 0.0."""
    if sample.answer is None:
        raise ValueError("math_correct needs the sample's reference answer")
    return _math_equal(sample.response, sample.answer)


@lru_cache(maxsize=1024)
def _math_equal(response: str, answer: str) -> float:
    """(A group's samples often give the same answer: ~1-3 ms of sympy each time otherwise.)"""
    # math-verify's own timeouts use SIGALRM, which only works on the main thread;
    # the scorer bounds the time instead, so they are turned off here.
    from math_verify import parse, verify

    gold = _parse_gold(answer)
    predicted = parse(response, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


def _warm_up_math_verify() -> None:
    """math-verify and sympy build parsers lazily, at the first input of each form (a
    number, a symbol, implicit multiplication, a fraction): 20-200 ms each time, paid
    within a run's first steps otherwise."""
    for response in ("\\boxed{12}", "\\boxed{a}", "\\boxed{1c1}", "\\boxed{\\frac{1}{2}}", "x^2 + 2x", "1.5"):
        _math_equal(response, "13")


math_correct.warm_up = _warm_up_math_verify  # type: ignore[attr-defined]  # the scorer's warm-up hook


@lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    from math_verify import parse

    # a reference already in math mode, or boxed, as it is; else wrapped in $...$ (an escaped
    # dollar, "\\$23.40", is a currency sign inside the answer, not math mode)
    math_mode = re.search(r"(?<!\\)\$", answer) or "\\boxed" in answer
    gold = parse(answer if math_mode else f"${answer}$", parsing_timeout=None)
    return gold or (parse(f"${answer}$", parsing_timeout=None) if math_mode else gold)


@REWARD_FUNCTIONS.register("format")
def format_reward(sample: RewardInput, pattern: str = DEFAULT_FORMAT_PATTERN) -> float:
    """1.0 if ``pattern`` (a regex, searched with DOTALL) occurs in the response."""
    return 1.0 if _compiled(pattern).search(sample.response) else 0.0


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


@REWARD_FUNCTIONS.register("length")
def length_reward(sample: RewardInput, budget: int = 256) -> float:
    """1.0 within ``budget`` response tokens, falling linearly to 0.0 at twice the budget
    (counts characters when the token count is unknown)."""
    if budget <= 0:
        raise ValueError(f"length budget must be > 0, got {budget}")
    n = sample.num_response_tokens if sample.num_response_tokens is not None else len(sample.response)
    return max(0.0, min(1.0, 2.0 - n / budget))


@REWARD_FUNCTIONS.register("overlong_penalty")
def overlong_penalty(sample: RewardInput, buffer: int = 4, max_tokens: int | None = None) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` response tokens, then
    falling linearly to -1 at ``max_tokens`` (default: the sampling limit) and beyond."""
    if buffer <= 0:
        raise ValueError(f"overlong_penalty buffer must be > 0, got {buffer}")
    limit = max_tokens if max_tokens is not None else sample.max_response_tokens
    if limit is None or sample.num_response_tokens is None:
        raise ValueError("overlong_penalty needs the response's token count and the sampling limit")
    over = sample.num_response_tokens - (limit - buffer)
    return -min(1.0, max(0.0, over / buffer))
