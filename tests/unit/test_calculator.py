"""The calculator tool under hostile input: whatever a policy samples is answered
``=error: WHY`` or a finite value within ``MAX_MAGNITUDE``, each within a time bound that
keeps it on the event loop; its kwargs are checked when the config loads."""

from __future__ import annotations

import asyncio
import math
import random
import re
import time

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.data.tasks import Problem
from moe_rl.environments import calculator
from moe_rl.rollout.multi_turn import Turn
from moe_rl.rollout.types import SamplingParams

TIME_BOUND_S = 0.005  # one evaluation, at most (measured: well under 1 ms for the worst cases below)
ANSWER = re.compile(r"=(?:error: [^\n]+|(-?[0-9.]+(?:e[+-][0-9]+)?)) \Z")
HOSTILE = {
    "99999999999999999999": "=error: number too large ",
    "1e999": "=error: not a finite number ",
    "-1e999": "=error: not a finite number ",
    "1e308*10": "=error: number too large ",
    "1" + "+1" * 1000: "=error: longer than 256 characters ",  # 2 kB: once a RecursionError
    "0x" + "f" * 1_500_000 + "%7": "=error: longer than 256 characters ",  # 1.5 MB: once 12 s
    "0x" + "f" * 60 + "//7": "=error: number too large ",
    "0b" + "1" * 100: "=error: number too large ",
    "0o" + "7" * 50: "=error: number too large ",
    "0x1f+0b11+0o7": "=41 ",
    "1/0": "=error: division by zero ",
    "7//0.0": "=error: division by zero ",
    "0%0": "=error: division by zero ",
    "9999999*9999999": "=error: result too large ",
    "999999*999999+1": "=999998000002 ",
    "1e12*1e12": "=error: result too large ",
    "-" * 200 + "3": "=3 ",
    "-+" * 100 + "5": "=5 ",
    "1" + "+1" * 127: "=128 ",
    "\u0661\u0662": "=error: not an expression: ASCII digits and + - * / // % only ",  # Arabic-Indic 12
    "\uff11+\uff12": "=error: not an expression: ASCII digits and + - * / // % only ",  # fullwidth 1+2
    "1\x002": "=error: not an expression ",
    "2**10": "=error: unsupported Pow ",
    "3j": "=error: unsupported Constant ",
    "'9'*9": "=error: unsupported Constant ",
    "__import__": "=error: unsupported Name ",
    "1 if 1 else 2": "=error: unsupported IfExp ",
    "": "=error: not an expression ",
    "1e-999": "=0 ",
    "1_000*3": "=3000 ",
    "7//2 + 7%2 - -1": "=5 ",
}


def timed_call(expression: str, timeout_s: float = 5.0) -> tuple[str, float]:
    """The tool's answer and its best time of three (scheduling noise left out)."""
    seconds = math.inf
    for _ in range(3):
        start = time.perf_counter()
        text, _ = calculator.call_tool(expression, timeout_s)
        seconds = min(seconds, time.perf_counter() - start)
    return text, seconds


def assert_bounded(expression: str, text: str, seconds: float) -> None:
    match = ANSWER.match(text)
    assert match, f"{expression[:60]!r} -> {text!r}"
    if match.group(1) is not None:
        value = float(match.group(1))
        assert math.isfinite(value) and abs(value) <= calculator.MAX_MAGNITUDE, (expression[:60], text)
    assert seconds < TIME_BOUND_S, f"{expression[:60]!r} took {seconds * 1e3:.2f} ms"


@pytest.mark.parametrize("expression", list(HOSTILE), ids=range(len(HOSTILE)))
def test_hostile_expressions_are_answered_in_bounded_time(expression: str) -> None:
    text, seconds = timed_call(expression)
    assert text == HOSTILE[expression]
    assert_bounded(expression, text, seconds)


def test_nesting_is_bounded_by_the_length_cap() -> None:
    """(A call cannot hold parentheses; ``evaluate`` alone bounds them all the same.)"""
    assert calculator.evaluate("(" * 127 + "-1" + ")" * 127) == -1  # the deepest 256 characters hold
    assert assert_bounded("(" * 127, *timed_call("(" * 127 + "-1" + ")" * 127)) is None
    with pytest.raises(calculator.ToolError, match="longer than"):
        calculator.evaluate("(" * 200 + "1" + ")" * 200)


def random_expression(rng: random.Random) -> str:
    """A string of hostile pieces: numbers of every size and base, operators, parentheses,
    unary chains, non-ASCII digits, junk."""
    pieces = [
        lambda: str(rng.randint(0, 10 ** rng.randint(1, 30))),
        lambda: f"{rng.random() * 10:.3f}e{rng.randint(-400, 400)}",
        lambda: rng.choice(["0x", "0b", "0o"]) + rng.choice(["f", "1", "7"]) * rng.randint(1, 60),
        lambda: rng.choice(["+", "-", "*", "/", "//", "%", "**", " ", "-" * rng.randint(1, 40)]),
        lambda: rng.choice(["(", ")", "(" * rng.randint(1, 90)]),
        lambda: rng.choice(["\u0663", "\uff15", "nan", "inf", "_", ".", "e", "x", "\x00", "\t"]),
    ]
    out = ""
    while len(out) < rng.choice([8, 40, 200, 300]):
        out += rng.choice(pieces)()
    return out


def test_a_fuzz_of_hostile_expressions_is_answered_in_bounded_time() -> None:
    rng = random.Random(0)
    answered = 0
    for _ in range(1500):
        expression = random_expression(rng)
        text, seconds = timed_call(expression)
        assert_bounded(expression, text, seconds)
        answered += not text.startswith("=error")
    assert answered > 20  # the fuzz reaches evaluation, not only the refusals


def test_well_formed_expressions_agree_with_python() -> None:
    """Small-operand expressions, left to right without parentheses: Python's own
    arithmetic is the independent reference wherever the calculator gives a value."""
    rng = random.Random(1)
    agreed = 0
    for _ in range(1000):
        terms = [str(rng.randint(0, 999)) if rng.random() < 0.8 else f"{rng.random() * 99:.2f}"]
        for _ in range(rng.randint(1, 8)):
            terms += [rng.choice(["+", "-", "*", "/", "//", "%", "- -"]), str(rng.randint(0, 99))]
        expression = " ".join(terms)
        try:
            value = calculator.evaluate(expression)
        except calculator.ToolError:
            continue
        assert math.isclose(value, eval(expression), rel_tol=1e-12, abs_tol=1e-9), expression  # our own strings
        agreed += 1
    assert agreed > 500


@pytest.mark.parametrize(
    "value, text",
    [
        (1234567 / 10, "123456.7"),
        (1000000.5 * 3, "3000001.5"),
        (123456789 / 1000, "123456.789"),
        (0.1 + 0.2, "0.3"),
        (1e-7, "0.0000001"),
        (2.0, "2"),
        (-5, "-5"),
    ],
)
def test_results_keep_their_digits_without_an_exponent(value: float, text: str) -> None:
    assert calculator.format_result(value) == text


def test_the_deadline_is_checked_during_evaluation() -> None:
    assert calculator.call_tool("1" + "+1" * 127, 1e-9) == ("=error: timed out ", True)
    assert calculator.call_tool("1" + "+1" * 127, 1.0) == ("=128 ", False)


class CharTokenizer:
    """One token per character (``)`` is one token, as the calculator needs)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedHandle:
    """An engine handle whose turn k writes ``script[k]``."""

    def __init__(self, script: list[str]) -> None:
        self.script, self.tokenizer = script, CharTokenizer()

    async def generate(self, token_ids, *, max_new_tokens=None, stop_token_ids=()) -> Turn:
        out = self.tokenizer.encode(self.script.pop(0))
        return Turn(list(token_ids), out, [0.0] * len(out), "stop", "0")


def test_a_hostile_policy_gets_errors_back_and_its_sample_goes_on() -> None:
    script = ["calc(" + "1+" * 1000 + "1)", "calc(1e999)", "calc(0x" + "f" * 200 + "%7)", "calc(6*7)", "42"]
    handle = ScriptedHandle(list(script))
    tokenizer = handle.tokenizer
    transcript = asyncio.run(
        calculator.generate(
            Problem("?", "42"),
            prompt_ids=tokenizer.encode("?"),
            engine=handle,
            tokenizer=tokenizer,
            sampling=SamplingParams(max_new_tokens=4096),
            max_turns=5,
        )
    )
    inserted = tokenizer.decode([t for t, m in zip(transcript.output_ids, transcript.loss_mask) if m == 0])
    assert inserted == ("=error: longer than 256 characters =error: not a finite number =error: number too large =42 ")
    assert transcript.meta == {"tool_calls": 4, "tool_failures": 3}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("max_turns=abc", "rollout.multi_turn.generate_kwargs.max_turns='abc' must be an integer >= 1"),
        ("max_turns=0", "rollout.multi_turn.generate_kwargs.max_turns=0 must be an integer >= 1"),
        ("max_turns=2.5", "rollout.multi_turn.generate_kwargs.max_turns=2.5 must be an integer >= 1"),
        ("max_turns=true", "rollout.multi_turn.generate_kwargs.max_turns=True must be an integer >= 1"),
        ("max_output_tokens=-1", "rollout.multi_turn.generate_kwargs.max_output_tokens=-1 must be an integer >= 0"),
        ("tool_timeout_s=-1", "rollout.multi_turn.generate_kwargs.tool_timeout_s=-1 must be a number of seconds > 0"),
        ("tool_timeout_s=0", "rollout.multi_turn.generate_kwargs.tool_timeout_s=0 must be a number of seconds > 0"),
        (
            "tool_timeout_s=.inf",
            "rollout.multi_turn.generate_kwargs.tool_timeout_s=inf must be a number of seconds > 0",
        ),
        (
            "tool_timeout_s=soon",
            "rollout.multi_turn.generate_kwargs.tool_timeout_s='soon' must be a number of seconds > 0",
        ),
    ],
)
def test_calculator_kwargs_are_checked_when_the_config_loads(override: str, message: str) -> None:
    fn = "rollout.multi_turn.generate_fn=moe_rl.environments.calculator:generate"
    with pytest.raises(ConfigError) as error:
        load_config(None, [fn, f"rollout.multi_turn.generate_kwargs.{override}"])
    assert str(error.value) == message


def test_good_calculator_kwargs_load() -> None:
    fn = "rollout.multi_turn.generate_fn=moe_rl.environments.calculator:generate"
    cfg = load_config(
        None,
        [fn, "rollout.multi_turn.generate_kwargs.max_turns=1", "rollout.multi_turn.generate_kwargs.tool_timeout_s=2"],
    )
    assert cfg.rollout.multi_turn.generate_kwargs == {"max_turns": 1, "tool_timeout_s": 2}
