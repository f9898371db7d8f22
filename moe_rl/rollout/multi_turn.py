"""Multi-turn (tool-use) rollouts: a user's async *generate function* drives the engine
turn by turn and returns a :class:`Transcript` (``rollout.multi_turn.generate_fn``).

A generate function is ``async def f(problem, *, prompt_ids, engine, tokenizer, sampling,
**rollout.multi_turn.generate_kwargs) -> Transcript``. It starts a ``Transcript(prompt_ids)``, calls
``await engine.generate(transcript.token_ids)`` for each policy turn (adding the
:class:`Turn` with ``transcript.add_policy``) and adds what the environment answers with
``transcript.add_environment(ids)``. Environment tokens are trained on as context only
(loss mask 0); the routing of every token comes from the engine (:class:`EngineHandle`
asks SGLang for each turn's new positions only, ``routed_experts_start_len``: SGLang
returns a cached prefix's routing from its KV slots, so the pieces join into the
routing of the whole sequence). :mod:`moe_rl.environments.calculator` is a worked example.

A sample whose function fails scores 0 in every reward and trains nothing (its tokens are
kept as context; counted as ``rollout/multi_turn/failed_samples``, the first reason in a
warning): the function raised (a ``CancelledError`` of its own included) or outlived
``rollout.multi_turn.timeout_s``, returned something other than a :class:`Transcript`, or
built one that is unusable (:class:`TranscriptError`: a turn that does not continue it, no
policy turn, log-probs that are not finite). An engine failure (:class:`RolloutError`)
stops the run; so does a step in which every sample failed (``rollout.multi_turn.max_failed_frac``).
A transcript longer than the model's context is cut to it (``Sample.truncation``
``"context"``). The transcript itself is :mod:`moe_rl.rollout.transcript`; the single-turn
sampler, its peer, :mod:`moe_rl.rollout.single_turn`.

The timeout is a cancellation, delivered at the function's next ``await``: a function that
ignores it is abandoned :data:`CANCEL_GRACE_S` later; one that blocks the event loop
(synchronous work between two awaits) stalls every sample and cannot be stopped, only
scored 0 when it ends late. Each stretch of a function's own code between two awaits is
timed (two clock reads per suspension, the engine's share left out); one of
:data:`BLOCKING_WARN_S` or more names the function in a warning.

A function may carry a check of its ``rollout.multi_turn.generate_kwargs`` (:func:`checks_kwargs`),
run when the config loads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Coroutine, Generator
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from moe_rl.rollout.transcript import Transcript, TranscriptError, Turn
from moe_rl.rollout.types import (
    GroupCallback,
    RolloutEngine,
    RolloutError,
    Sample,
    SampleStatus,
    SamplingParams,
    TurnSource,
    Truncation,
    run_groups,
    sample_seed,
)

log = logging.getLogger(__name__)

GENERATE_ARGS = ("prompt_ids", "engine", "tokenizer", "sampling")  # keyword arguments every generate function takes
GenerateFn = Callable[..., Coroutine[Any, Any, Transcript]]  # an ``async def`` (its steps are timed)
KWARGS_CHECK = "check_kwargs"  # attribute of a generate function: its check of rollout.multi_turn.generate_kwargs
BLOCKING_WARN_S = 0.5  # a generate function holding the event loop this long without an await is warned about
CANCEL_GRACE_S = 1.0  # a timed-out function has this long to stop after its cancellation, then it is abandoned


class FunctionCancelled(RuntimeError):
    """A generate function raised ``CancelledError`` of its own accord (its sample scores 0)."""


class LoopClock:
    """How long a sample's code held the event loop: ``engine_seconds`` in the engine
    handle, ``longest`` the longest stretch of the generate function's own code between two
    suspensions (the engine handle's work inside it left out)."""

    def __init__(self) -> None:
        self.engine_seconds = 0.0
        self.longest = 0.0


class _TimedSteps:
    """Awaits ``coro`` as ``await coro`` would, timing each of its steps (what runs between
    two suspensions) into ``clock``: as the engine's, or (``engine=False``) as the
    function's own, less what engine steps inside it took."""

    def __init__(self, coro: Coroutine[Any, Any, Any], clock: LoopClock, *, engine: bool) -> None:
        self.coro, self.clock, self.engine = coro, clock, engine

    def __await__(self) -> Generator[Any, Any, Any]:
        value, error = None, None
        while True:
            start, engine_before = time.perf_counter(), self.clock.engine_seconds
            try:
                yielded = self.coro.send(value) if error is None else self.coro.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                self._count(time.perf_counter() - start, engine_before)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:  # closed (an abandoned sample garbage-collected): close the coroutine too
                self.coro.close()
                raise
            except BaseException as e:  # a cancellation goes on to the coroutine
                value, error = None, e

    def _count(self, seconds: float, engine_before: float) -> None:
        if self.engine:
            self.clock.engine_seconds += seconds
        else:
            self.clock.longest = max(self.clock.longest, seconds - (self.clock.engine_seconds - engine_before))


async def timed(coro: Coroutine[Any, Any, Any], clock: LoopClock, *, engine: bool = False) -> Any:
    """``await coro``, its steps timed into ``clock`` (:class:`_TimedSteps`)."""
    return await _TimedSteps(coro, clock, engine=engine)


class EngineHandle:
    """One sample's access to the engine: its sampling settings and seed (each turn gets
    its own), the run's concurrency limit, and routing when the run needs it. With
    ``max_tokens`` (the model's context) a turn samples at most up to it; a turn asked for
    at the context gets no tokens (finish reason ``"length"``; asked for again:
    :class:`TranscriptError`)."""

    def __init__(self, source: TurnSource, sampling: SamplingParams, seed: int, max_tokens: int | None = None) -> None:
        self._source, self.sampling, self.seed, self.max_tokens = source, sampling, seed, max_tokens
        self.turns: list[Turn] = []
        self.seconds = 0.0  # spent with a turn in the engine (up to the last time none was)
        self.engine_since: float | None = None  # since when a turn has been in the engine (None: none is)
        self._in_engine = 0  # turns in the engine now (a function may ask for several at once)
        self.out_of_engine = asyncio.Event()  # set while no turn is in the engine
        self.out_of_engine.set()
        self.clock = LoopClock()
        self.context_full = False  # a turn was cut at the model's context, or got no room there
        self._refused = False  # a turn at the context got no tokens

    async def generate(
        self, token_ids: Sequence[int], *, max_new_tokens: int | None = None, stop_token_ids: Sequence[int] = ()
    ) -> Turn:
        """Sample a continuation of ``token_ids`` (at most ``max_new_tokens``, default the
        run's ``rollout.max_new_tokens``; stopping at EOS and at ``stop_token_ids``)."""
        return await timed(self._generate(token_ids, max_new_tokens, stop_token_ids), self.clock, engine=True)

    async def _generate(
        self, token_ids: Sequence[int], max_new_tokens: int | None, stop_token_ids: Sequence[int]
    ) -> Turn:
        ids = [int(t) for t in token_ids]
        if max_new_tokens is not None and max_new_tokens < 1:  # not "the default": a budget spent
            raise TranscriptError(f"asked for a turn of max_new_tokens={max_new_tokens}: end the transcript instead")
        limit = self.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        room = limit if self.max_tokens is None else min(limit, self.max_tokens - len(ids))
        if room <= 0:
            return self._at_context(ids)
        params = replace(
            self.sampling,
            max_new_tokens=room,
            stop_token_ids=tuple(dict.fromkeys((*self.sampling.stop_token_ids, *stop_token_ids))),
        )
        known, routing_from = self._known_routing(ids)
        self._enter_engine()
        try:
            sample = await self._source.generate(
                ids, params, seed=turn_seed(self.seed, len(self.turns)), routing_from=routing_from
            )
        finally:
            self._leave_engine()
        routed = sample.routed_experts
        if routed is not None and known is not None:
            routed = torch.cat([known, routed])
        turn = Turn(
            ids,
            list(sample.output_ids),
            list(sample.output_logprobs),
            sample.finish_reason,
            sample.weight_version,
            routed,
        )
        self.turns.append(turn)
        if room < limit and turn.finish_reason == "length":
            self.context_full = True
        return turn

    def engine_seconds(self, now: float) -> float:
        """Seconds with at least one turn in the engine up to ``now``, turns in flight included."""
        return self.seconds + (now - self.engine_since if self.engine_since is not None else 0.0)

    def _enter_engine(self) -> None:
        if self._in_engine == 0:
            self.engine_since = time.perf_counter()
            self.out_of_engine.clear()
        self._in_engine += 1

    def _leave_engine(self) -> None:
        self._in_engine -= 1
        if self._in_engine == 0 and self.engine_since is not None:
            self.seconds += time.perf_counter() - self.engine_since
            self.engine_since = None
            self.out_of_engine.set()

    def _at_context(self, ids: list[int]) -> Turn:
        """A turn without tokens for a request at the model's context (once)."""
        last = self.turns[-1] if self.turns else None
        if self._refused or last is None:
            raise TranscriptError(
                f"asked for a turn of {len(ids)} tokens, at the model's context of {self.max_tokens} tokens"
                + (" again (a turn there gets no tokens: end the transcript)" if last is not None else "")
            )
        self._refused = self.context_full = True
        return Turn(ids, [], [], "length", last.weight_version, last.routed_experts)

    def _known_routing(self, ids: list[int]) -> tuple[Tensor | None, int]:
        """The routing the last turn already holds for a prefix of ``ids`` (when ``ids``
        continue it), and how many positions that is."""
        if not self.turns or self.turns[-1].routed_experts is None:
            return None, 0
        last = self.turns[-1]
        sequence = last.input_ids + last.output_ids
        if len(ids) < len(sequence) or ids[: len(sequence)] != sequence:
            return None, 0
        return last.routed_experts, len(sequence) - 1


def turn_seed(seed: int, turn: int) -> int:
    """Turn 0 samples with the sample's own seed (as a single-turn rollout does)."""
    return seed if turn == 0 else (seed * 1_000_003 + 7919 * turn) % (2**31 - 1)


# ------------------------------------------------------------------ loading the function


def load_generate_fn(spec: str) -> GenerateFn:
    """``"package.module:function"``, checked: an ``async def`` taking the problem and the
    keyword arguments :data:`GENERATE_ARGS`. ``ValueError`` in one line otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rollout.multi_turn.generate_fn={spec!r} must be 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # a user's module may fail in any way while importing
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"rollout.multi_turn.generate_fn={spec!r} cannot be imported: {reason}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.multi_turn.generate_fn={spec!r} must be an async function (async def)")
    return fn


def checks_kwargs(check: Callable[[dict[str, Any]], None]) -> Callable[[GenerateFn], GenerateFn]:
    """Decorates a generate function with ``check(rollout.multi_turn.generate_kwargs)``, run when the
    config loads: it raises ``ValueError`` in one line naming the key and value."""

    def decorate(fn: GenerateFn) -> GenerateFn:
        setattr(fn, KWARGS_CHECK, check)
        return fn

    return decorate


def function_name(fn: Callable[..., Any]) -> str:
    """``module:qualname``, as ``rollout.multi_turn.generate_fn`` names it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def check_generate_fn(spec: str, kwargs: dict[str, Any]) -> None:
    """``ValueError`` unless ``spec`` loads, takes ``(problem, *, prompt_ids, engine,
    tokenizer, sampling, **kwargs)`` and its own check (:func:`checks_kwargs`) passes."""
    fn = load_generate_fn(spec)
    try:
        inspect.signature(fn).bind(None, **{name: None for name in GENERATE_ARGS}, **kwargs)
    except TypeError as e:
        raise ValueError(
            f"rollout.multi_turn.generate_fn={spec!r} must take (problem, *, {', '.join(GENERATE_ARGS)}"
            f"{', ' + ', '.join(sorted(kwargs)) if kwargs else ''}): {e}"
        ) from None
    check = getattr(fn, KWARGS_CHECK, None)
    if check is not None:
        check(dict(kwargs))


# ------------------------------------------------------------------ the sampler


class MultiTurnSampler:
    """``n`` transcripts of each problem from ``fn``, all concurrently (within the engine's
    concurrency limit: ``rollout.server.concurrency`` per SGLang server), each cut to
    ``max_tokens`` (the model's context) when given."""

    def __init__(
        self,
        engine: RolloutEngine,
        fn: GenerateFn,
        tokenizer: Any,
        *,
        kwargs: dict[str, Any],
        timeout_s: float,
        max_tokens: int | None = None,
    ) -> None:
        self.engine, self.fn, self.tokenizer = engine, fn, tokenizer
        self.kwargs, self.timeout_s, self.max_tokens = dict(kwargs), timeout_s, max_tokens
        self._warned: set[str] = set()  # what has been warned about once
        self._traceback_shown = False  # this sample() call's first failure was logged with its traceback

    def sample(
        self,
        problems: Sequence[Any],
        prompts: Sequence[list[int]],
        n: int,
        params: SamplingParams,
        *,
        seed: int,
        routed: bool,
        on_group: GroupCallback | None = None,
    ) -> list[list[Sample]]:
        """Every transcript a task of one event loop; ``on_group`` as each problem's last one ends."""
        params.validate()
        self._traceback_shown = False
        try:
            return run_abandoning(self._sample_all(problems, prompts, n, params, seed, routed, on_group))
        except KeyboardInterrupt as e:  # asyncio lets it through at once, from any sample
            raise KeyboardInterrupt(
                str(e)
                or f"interrupted during the rollout (a second Ctrl-C, or a KeyboardInterrupt raised by"
                f" rollout.multi_turn.generate_fn={function_name(self.fn)}); the step in progress is lost"
            ) from None

    async def _sample_all(
        self, problems, prompts, n: int, params: SamplingParams, seed: int, routed: bool, on_group: GroupCallback | None
    ) -> list[list[Sample]]:
        async with self.engine.turns(return_routed_experts=routed) as source:
            return await run_groups(
                lambda i, j: self._one(source, problems[i], prompts[i], params, sample_seed(seed, i, j, n), routed),
                len(prompts),
                n,
                on_group,
            )

    async def _one(
        self, source: TurnSource, problem: Any, prompt: list[int], params: SamplingParams, seed: int, routed: bool
    ) -> Sample:
        handle = EngineHandle(source, params, seed, self.max_tokens)
        start = time.perf_counter()
        call = self.fn(
            problem, prompt_ids=list(prompt), engine=handle, tokenizer=self.tokenizer, sampling=params, **self.kwargs
        )
        try:
            transcript = await self._within_timeout(call, handle)
            if not isinstance(transcript, Transcript):
                raise TranscriptError(f"the generate function returned {type(transcript).__name__}, not a Transcript")
            sample = transcript.to_sample(seed, self.max_tokens)
        except RolloutError:  # the engine failed (or served other weights): the run stops
            raise
        except Exception as e:  # the function or its environment failed (or timed out): the sample scores 0
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not self._traceback_shown and not isinstance(e, (TranscriptError, TimeoutError, FunctionCancelled)):
                # the step's first error of the function's own, with where it happened
                self._traceback_shown = True
                log.warning(
                    "a sample failed in rollout.multi_turn.generate_fn=%s", function_name(self.fn), exc_info=True
                )
            sample = await self._failed_sample(source, handle, prompt, params, seed, routed, why)
        if handle.context_full and sample.status is not SampleStatus.FAILED:
            sample.truncation = Truncation.CONTEXT
        sample.meta.update(
            turns=len(handle.turns),
            policy_tokens=sample.policy_token_count,
            environment_tokens=len(sample.output_ids) - sample.policy_token_count,
            environment_seconds=max(0.0, time.perf_counter() - start - handle.seconds),
        )
        return sample

    async def _within_timeout(self, call: Coroutine[Any, Any, Any], handle: EngineHandle) -> Any:
        """What ``call`` returns; ``TimeoutError`` when it spends more than ``timeout_s``
        outside the engine's turns (its own code and its environment's: the time a turn waits
        for the engine, a server slot included, does not count), cancelled then and abandoned
        when it is still running :data:`CANCEL_GRACE_S` later; also when it returns late
        because it blocked the event loop."""
        start = time.perf_counter()

        def outside_engine() -> float:
            now = time.perf_counter()
            return now - start - handle.engine_seconds(now)

        task = asyncio.ensure_future(timed(call, handle.clock))
        try:
            while not task.done() and (left := self.timeout_s - outside_engine()) > 0:
                if handle.engine_since is None:
                    await asyncio.wait({task}, timeout=left)
                    continue
                back = asyncio.ensure_future(handle.out_of_engine.wait())  # a turn in flight stops the clock
                await asyncio.wait({task, back}, return_when=asyncio.FIRST_COMPLETED)
                back.cancel()
            if not task.done():
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
                if not done:
                    self._warn_once(
                        "abandoned",
                        "ignored its cancellation at rollout.multi_turn.timeout_s and was abandoned"
                        " (catch CancelledError only to clean up, then raise it again)",
                    )
                    raise TimeoutError("ignored its cancellation: abandoned")
                if task.cancelled():
                    raise TimeoutError
                # it ended on its own (with the timeout due at once, or despite its cancellation): late below
        except asyncio.CancelledError:  # this sample's own task was cancelled (the run is stopping)
            task.cancel()
            raise
        finally:
            self._warn_if_blocking(handle.clock)
        if task.cancelled():  # done without a cancellation of ours: the function raised CancelledError itself
            raise FunctionCancelled("the generate function raised CancelledError (moe-rl did not cancel it)")
        result = task.result()
        if (spent := outside_engine()) > self.timeout_s:  # it blocked the event loop past its deadline
            raise TimeoutError(
                f"ran {spent:.1f} s outside engine turns, past rollout.multi_turn.timeout_s={self.timeout_s:g}"
            )
        return result

    def _warn_if_blocking(self, clock: LoopClock) -> None:
        if clock.longest >= BLOCKING_WARN_S:
            self._warn_once(
                "blocking",
                f"held the event loop for {clock.longest:.2f} s without an await: every sample and the engine"
                " waited meanwhile, and rollout.multi_turn.timeout_s cannot interrupt it; run blocking work with"
                " await asyncio.to_thread(...)",
            )

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("rollout.multi_turn.generate_fn=%s %s", function_name(self.fn), message)

    async def _failed_sample(
        self,
        source: TurnSource,
        handle: EngineHandle,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        routed: bool,
        why: str,
    ) -> Sample:
        """A sample of what the last turn saw and sampled, none of it trained on; with no
        such turn the bare prompt (its routing from a one-token request when needed and the
        prompt leaves room for it; else none, which the batch fills)."""
        last = next((t for t in reversed(handle.turns) if t.input_ids[: len(prompt)] == prompt), None)
        room = self.max_tokens is None or len(prompt) < self.max_tokens  # (else the engine refuses the probe)
        if last is None and routed and room:
            probe = await source.generate(prompt, replace(params, max_new_tokens=1), seed=seed)
            assert probe.routed_experts is not None  # routed: the source returns routing
            last = Turn(prompt, [], [], "abort", "", probe.routed_experts[: len(prompt) - 1])
        output = (last.input_ids[len(prompt) :] + last.output_ids) if last is not None else []
        routing = last.routed_experts if last is not None else None
        if self.max_tokens is not None and len(prompt) + len(output) > self.max_tokens:
            output = output[: max(0, self.max_tokens - len(prompt))]
            routing = routing[: len(prompt) + len(output) - 1] if routing is not None else None
        return Sample(
            prompt_ids=list(prompt),
            output_ids=output,
            output_logprobs=[0.0] * len(output),
            finish_reason="abort",
            weight_version=last.weight_version
            if last is not None and last.weight_version
            else self.engine.weight_version,
            seed=seed,
            routed_experts=routing,
            loss_mask=[0] * len(output),
            failure=why,
        )


class DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """An event loop's default executor (``asyncio.to_thread``, a tool's blocking call):
    at most ``workers`` daemon threads, each taking calls in turn. A thread pool's threads
    are joined when the interpreter exits, so one tool call that never returns (its sample
    long timed out) would keep the trainer's process alive after the run ended; these
    threads are left behind instead."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers)  # (asyncio takes only a ThreadPoolExecutor; its pool stays unused)
        self.workers = workers
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._idle = 0  # threads waiting for a call, not yet promised one
        self.running = 0  # calls started and not yet returned

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        with self._lock:
            if self._idle:  # an idle thread takes it (promised: no other call counts on that one)
                self._idle -= 1
                return future
            if self._started >= self.workers:  # it waits for a thread to come free
                return future
            self._started += 1
        threading.Thread(target=self._serve, daemon=True, name="moe-rl-to-thread").start()
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._calls.get()
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self.running += 1
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                    future.set_exception(e)
                finally:
                    with self._lock:
                        self.running -= 1
            with self._lock:
                self._idle += 1


def run_abandoning(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(main)``, except that tasks still running at its end (a generate
    function that ignored its cancellation) get :data:`CANCEL_GRACE_S` to stop after being
    cancelled and are then left behind, not waited for; so are blocking calls of theirs
    still running on the loop's threads (:class:`DaemonThreads`), named in a warning."""
    loop = asyncio.new_event_loop()
    threads = DaemonThreads(min(32, (os.cpu_count() or 1) + 4))  # (asyncio's own default)
    loop.set_default_executor(threads)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=CANCEL_GRACE_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
            if threads.running:
                log.warning(
                    "%d blocking call(s) of the rollout (asyncio.to_thread) still running after their samples ended:"
                    " left behind on daemon threads (give the tool a timeout of its own)",
                    threads.running,
                )
