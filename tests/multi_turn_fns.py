"""Generate functions the multi-turn tests train with (``rollout.generate_fn=multi_turn_fns:NAME``,
with ``tests/`` on ``PYTHONPATH``)."""

from __future__ import annotations

import asyncio
import time

from moe_rl.rollout.multi_turn import Transcript


async def one_turn(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """The single-turn rollout written as a generate function."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids))
    return transcript


async def two_turns(
    problem, *, prompt_ids, engine, tokenizer, sampling, inserted: str = " ok ", first: int = 3
) -> Transcript:
    """A policy turn of at most ``first`` tokens, fixed environment tokens, a second turn
    (unless the first one stopped), then environment tokens after it (left out)."""
    transcript = Transcript(prompt_ids)
    turn = await engine.generate(transcript.token_ids, max_new_tokens=first)
    transcript.add_policy(turn)
    if turn.finish_reason != "stop":
        transcript.add_environment(tokenizer.encode(inserted, add_special_tokens=False))
        transcript.add_policy(await engine.generate(transcript.token_ids))
        transcript.meta["tool_calls"] = 1
    transcript.add_environment(tokenizer.encode(" end", add_special_tokens=False))
    return transcript


async def sometimes_fails(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """Raises after its first turn for every other problem (by the answer's parity)."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids))
    if int(problem.answer) % 2:
        raise ConnectionError("the environment went away")
    return transcript


async def hangs(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


async def blocks(problem, *, prompt_ids, engine, tokenizer, sampling, seconds: float = 0.2) -> Transcript:
    """A turn, then ``seconds`` of synchronous sleep on the event loop (no await)."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids))
    time.sleep(seconds)
    return transcript


async def ignores_cancellation(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


def not_async(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    raise AssertionError("never called")


async def too_few_args(problem, *, prompt_ids) -> Transcript:
    raise AssertionError("never called")


def always_zero(sample, **kwargs) -> float:
    """A reward that never pays (the flat-reward warning's case)."""
    return 0.0
