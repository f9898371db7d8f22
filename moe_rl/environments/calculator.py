"""A calculator tool for multi-step arithmetic: the worked example of a generate function.

The policy writes ``calc(EXPR)``; its turn stops at the closing ``)`` (one token under the
tokenizer) and the environment appends ``=RESULT `` (or ``=error: WHY `` for an expression
it cannot evaluate), then the policy continues. The sample ends when a turn makes no tool
call (it answered, hit EOS or its token limit), after ``max_turns`` policy turns, or when
its output reaches ``max_output_tokens``. Expressions are numbers and ``+ - * / // %``
(no parentheses: the call ends at the first ``)``), evaluated from Python's AST (no code
runs); each call may take at most ``tool_timeout_s``.

    rollout.generate_fn: moe_rl.environments.calculator:generate
    rollout.generate_kwargs: {max_turns: 4}
"""

from __future__ import annotations

import ast
import asyncio
import operator
import re
from typing import Any

from moe_rl.rollout.multi_turn import EngineHandle, Transcript

CALL = re.compile(r"calc\(([^()]*)\)$")  # a turn stops at the first ")": no parentheses inside
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
}
MAX_MAGNITUDE = 10**12


class ToolError(ValueError):
    """An expression the calculator refuses (its message goes back to the policy)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (``ToolError`` for anything else)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError("not an expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        try:
            result = _OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if abs(result) > MAX_MAGNITUDE:
            raise ToolError("result too large")
        return result
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ToolError(f"unsupported {what}")


def format_result(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def close_token_id(tokenizer: Any, close: str = ")") -> int:
    """The one token that ends a tool call (``ValueError`` when ``close`` is several)."""
    ids = tokenizer.encode(close, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the calculator's closing {close!r} is {len(ids)} tokens under this tokenizer, not one")
    return ids[0]


async def call_tool(expression: str, timeout_s: float) -> tuple[str, bool]:
    """``(text to append, failed)``: ``=RESULT `` or ``=error: WHY ``."""
    try:
        value = await asyncio.wait_for(asyncio.to_thread(evaluate, expression), timeout_s)
    except ToolError as e:
        return f"=error: {e} ", True
    except TimeoutError:
        return "=error: timed out ", True
    return f"={format_result(value)} ", False


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
        text, failed = await call_tool(call.group(1), tool_timeout_s)
        calls, failures = calls + 1, failures + failed
        transcript.add_environment(tokenizer.encode(text, add_special_tokens=False))
    transcript.meta.update(tool_calls=calls, tool_failures=failures)
    return transcript
