"""Generate functions the multi-turn tests train with (``rollout.multi_turn.generate_fn=multi_turn_fns:NAME``,
with ``tests/support/`` on ``PYTHONPATH``)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
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


async def skips_a_token(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """A turn that does not continue the transcript (its last token left out)."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids[:-1]))
    return transcript


async def returns_none(problem, *, prompt_ids, engine, tokenizer, sampling):
    await engine.generate(prompt_ids)


async def returns_dict(problem, *, prompt_ids, engine, tokenizer, sampling):
    turn = await engine.generate(prompt_ids)
    return {"output_ids": turn.output_ids}


async def no_policy_turn(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    transcript = Transcript(prompt_ids)
    transcript.add_environment(tokenizer.encode(" hello", add_special_tokens=False))
    return transcript


async def nan_logprobs(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """A turn whose log-probs are NaN (as a broken engine's would be)."""
    transcript = Transcript(prompt_ids)
    turn = await engine.generate(transcript.token_ids)
    transcript.add_policy(dataclasses.replace(turn, logprobs=[math.nan] * len(turn.output_ids)))
    return transcript


async def one_logprob_too_many(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """A turn edited to cut its tokens but not its log-probs (every later token would get
    its neighbour's)."""
    transcript = Transcript(prompt_ids)
    turn = await engine.generate(transcript.token_ids)
    transcript.add_policy(dataclasses.replace(turn, output_ids=turn.output_ids[:-1]))
    return transcript


async def raises_cancelled(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """A CancelledError of its own (an inner task it awaited was cancelled)."""
    await engine.generate(prompt_ids)
    raise asyncio.CancelledError


async def raises_keyboard_interrupt(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    raise KeyboardInterrupt


async def fails_after_a_turn(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """Always raises after its first turn."""
    await engine.generate(prompt_ids)
    raise ConnectionError("the environment went away")


async def spends_its_budget(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """A first turn, then a turn with what is left of a budget of its own: nothing."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids))
    transcript.add_policy(await engine.generate(transcript.token_ids, max_new_tokens=0))
    return transcript


async def odd_meta(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """A transcript whose meta holds a string and a NaN where the metrics read numbers."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids))
    transcript.meta.update(tool_calls="three", tool_failures=math.nan)
    return transcript


async def overlong(problem, *, prompt_ids, engine, tokenizer, sampling, inserted: int = 300) -> Transcript:
    """A turn, ``inserted`` environment tokens (past a small model's context), turns until
    one gets no tokens (the engine handle's answer at the context)."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids, max_new_tokens=2))
    transcript.add_environment(tokenizer.encode(" 1" * inserted, add_special_tokens=False))
    for _ in range(3):
        turn = await engine.generate(transcript.token_ids)
        transcript.add_policy(turn)
        if not turn.output_ids:
            break
    return transcript


def not_async(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    raise AssertionError("never called")


async def too_few_args(problem, *, prompt_ids) -> Transcript:
    raise AssertionError("never called")


def always_zero(sample, **kwargs) -> float:
    """A reward that never pays (the flat-reward warning's case)."""
    return 0.0


async def fails_by_seed(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """Raises after its first turn for the samples of odd seed (within a group too)."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids))
    if engine.seed % 2:
        raise ConnectionError("the environment went away")
    return transcript


async def inserts_token(problem, *, prompt_ids, engine, tokenizer, sampling, token: int) -> Transcript:
    """A turn, ``token`` inserted, another turn."""
    transcript = Transcript(prompt_ids)
    transcript.add_policy(await engine.generate(transcript.token_ids, max_new_tokens=2))
    transcript.add_environment([token])
    transcript.add_policy(await engine.generate(transcript.token_ids, max_new_tokens=2))
    return transcript


async def tool_never_returns(problem, *, prompt_ids, engine, tokenizer, sampling, seconds: float = 3.0) -> Transcript:
    """A blocking tool call, run as the docs advise (``asyncio.to_thread``), that outlives any timeout."""
    await asyncio.to_thread(time.sleep, seconds)
    raise AssertionError("unreachable within the test's timeout")


async def best_of_two(problem, *, prompt_ids, engine, tokenizer, sampling) -> Transcript:
    """Two turns asked for at once on the same context; the first one kept."""
    transcript = Transcript(prompt_ids)
    first, _ = await asyncio.gather(engine.generate(transcript.token_ids), engine.generate(transcript.token_ids))
    transcript.add_policy(first)
    return transcript
