"""A calculator tool for multi-step arithmetic: the worked example of a generate function.

The policy writes ``calc(EXPR)``; its turn stops at the closing ``)`` (one token under the
tokenizer) and the environment appends ``=RESULT `` (or ``=error: WHY `` for an expression
it cannot evaluate), then the policy continues. The sample ends when a turn makes no tool
call (it answered, hit EOS or its token limit), after ``max_turns`` policy turns, or when
its output reaches ``max_output_tokens``. Expressions are numbers and ``+ - * / // %``
(no parentheses: the call ends at the first ``)``), evaluated from Python's AST (no code
runs).

The expression is whatever the policy sampled, so it is treated as hostile: at most
:data:`MAX_EXPRESSION_CHARS` ASCII characters, every literal and every intermediate result
within :data:`MAX_MAGNITUDE` (finite), every failure an ``=error: WHY`` for the policy.
These caps make an evaluation cheap by construction (at most ~128 operations on numbers
below 2**40, each constant time; tests/unit/test_calculator.py measures the worst cases well
under a millisecond), so it runs on the event loop itself, and ``tool_timeout_s`` is a
deadline checked before every AST node: it holds to within one such operation.

    rollout.multi_turn.generate_fn: moe_rl.environments.calculator:generate
    rollout.multi_turn.generate_kwargs: {max_turns: 4}
"""

from __future__ import annotations

import numpy as np

import ast
import math
import operator
import re
import time
import warnings
from typing import Any

from moe_rl.rollout.multi_turn import EngineHandle, Transcript, checks_kwargs

CALL = re.compile(r"calc\(([^()]*)\)$")  # a turn stops at the first ")": no parentheses inside
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
}
MAX_MAGNITUDE = 10**12  # every literal and every intermediate result: |value| <= this
MAX_EXPRESSION_CHARS = 256  # longer expressions are refused before they are parsed


class ToolError(ValueError):
    """An expression the calculator refuses (its message goes back to the policy)."""


def evaluate(expression: str, *, deadline: float = math.inf) -> int | float:
    """The value of an arithmetic expression (``ToolError`` for anything else, and once
    ``time.perf_counter()`` passes ``deadline``)."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    if not text.isascii():
        raise ToolError("not an expression: ASCII digits and + - * / // % only")
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" and the like: the policy's, not the run's
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
        return _value(tree.body, deadline)
    except ToolError:
        raise
    except (SyntaxError, ValueError):  # ValueError: a null byte, a literal Python cannot convert
        raise ToolError("not an expression") from None
    except (ArithmeticError, RecursionError, MemoryError) as e:  # unreachable under the caps: refused all the same
        raise ToolError(type(e).__name__) from None


def _value(node: ast.AST, deadline: float) -> int | float:
    if time.perf_counter() > deadline:
        raise ToolError("timed out")
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value, "number too large")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand, deadline)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left, deadline), _value(node.right, deadline)
        try:
            result = _OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        return _bounded(result, "result too large")
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ToolError(f"unsupported {what}")


def _bounded(value: int | float, too_large: str) -> int | float:
    """``value`` when finite and within :data:`MAX_MAGNITUDE`."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(too_large)
    return value


def format_result(value: int | float) -> str:
    """In positional notation, to 15 significant digits (all a double holds: results are
    below 1e12), never an exponent the policy would have to read."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else np.format_float_positional(float(f"{value:.15g}"), trim="-")


def close_token_id(tokenizer: Any, close: str = ")") -> int:
    """The one token that ends a tool call (``ValueError`` when ``close`` is several)."""
    ids = tokenizer.encode(close, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the calculator's closing {close!r} is {len(ids)} tokens under this tokenizer, not one")
    return ids[0]


def call_tool(expression: str, timeout_s: float) -> tuple[str, bool]:
    """``(text to append, failed)``: ``=RESULT `` or ``=error: WHY ``."""
    try:
        value = evaluate(expression, deadline=time.perf_counter() + timeout_s)
    except ToolError as e:
        return f"=error: {e} ", True
    return f"={format_result(value)} ", False


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """``ValueError`` in one line for a calculator argument out of range (at config load)."""
    for key, minimum in (("max_turns", 1), ("max_output_tokens", 0)):
        value = kwargs.get(key, minimum)
        if type(value) is not int or value < minimum:
            raise ValueError(f"rollout.multi_turn.generate_kwargs.{key}={value!r} must be an integer >= {minimum}")
    timeout = kwargs.get("tool_timeout_s", 1.0)
    if type(timeout) not in (int, float) or not 0 < timeout < math.inf:
        raise ValueError(
            f"rollout.multi_turn.generate_kwargs.tool_timeout_s={timeout!r} must be a number of seconds > 0"
        )


@checks_kwargs(check_kwargs)
async def generate(
    problem: Any,
    *,
    prompt_ids: list[int],
    engine: EngineHandle,
    tokenizer: Any,
    sampling: Any,
    max_turns: int = 4,
    max_output_tokens: int = 0,
    tool_timeout_s: float = 5.0,
) -> Transcript:
    """Policy turns with calculator calls between them (see the module docstring);
    ``max_output_tokens`` 0: ``max_turns * rollout.max_new_tokens``."""
    budget = max_output_tokens or max_turns * sampling.max_new_tokens
    stop = close_token_id(tokenizer)
    transcript = Transcript(prompt_ids)
    calls = failures = 0
    for turn_number in range(max_turns):
        room = budget - len(transcript.output_ids)
        if room <= 0:
            transcript.meta["truncated"] = "tokens"
            break
        turn = await engine.generate(
            transcript.token_ids, max_new_tokens=min(room, sampling.max_new_tokens), stop_token_ids=[stop]
        )
        transcript.add_policy(turn)
        call = (
            CALL.search(tokenizer.decode(turn.output_ids)) if turn.output_ids and turn.output_ids[-1] == stop else None
        )
        if call is None:  # an answer, EOS or the turn's token limit: the sample is done
            if turn.finish_reason == "length" and len(transcript.output_ids) >= budget:
                transcript.meta["truncated"] = "tokens"
            break
        if turn_number == max_turns - 1:
            transcript.meta["truncated"] = "turns"
            break
        text, failed = call_tool(call.group(1), tool_timeout_s)
        calls, failures = calls + 1, failures + failed
        transcript.add_environment(tokenizer.encode(text, add_special_tokens=False))
    transcript.meta.update(tool_calls=calls, tool_failures=failures)
    return transcript
