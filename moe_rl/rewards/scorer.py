"""The scorer that turns samples into named reward columns.

It runs every configured reward function on every sample, in a thread of the first rank or
in worker processes (:mod:`moe_rl.rewards.pool`); a function that raises, runs past its
timeout or returns NaN/Inf scores 0 for that sample, is counted per reward and per kind,
and never stops the run. Samples may also be handed over while others still generate
(:meth:`RewardScorer.submit`, a feeder thread drives the reward thread or the pool) and
collected together at the end (:meth:`RewardScorer.gather`), with the same results.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from moe_rl.algorithms.reward_shaping import conditional_reward
from moe_rl.rewards.base import (
    ConditionalSpec,
    RewardBatch,
    RewardFn,
    RewardInput,
    RewardSpec,
    resolve_reward_fn,
    reward_outcome,
    warm_up,
)

log = logging.getLogger(__name__)

Outcome = tuple[float, str | None]  # a reward call's value, and its failure kind (None: it did not fail)
WARM_UP_TIMEOUT_S = 120.0  # the rewards' warm-up (lazy imports, parser tables) may take this long


class RewardScorer:
    """Scores samples with several named rewards, safely; see the module docstring."""

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        conditionals: Sequence[ConditionalSpec] = (),
        timeout_s: float = 10.0,
        workers: int = 0,
        keep_special_tokens: bool = False,
        score_as_finished: bool = False,
    ) -> None:
        self.keep_special_tokens = keep_special_tokens  # the text it scores keeps special tokens
        self.score_as_finished = score_as_finished  # its callers submit each group as it finishes
        if not specs:
            raise ValueError("at least one reward is needed")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        for c in conditionals:
            for ref in (c.target, c.condition):
                if ref not in names:
                    raise ValueError(f"conditional reward refers to unknown reward {ref!r}; rewards: {names}")
        self.specs = list(specs)
        self.names = names
        self.weights = [float(s.weight) for s in specs]
        self.conditionals = list(conditionals)
        self.timeout_s = timeout_s
        self._fns = [resolve_reward_fn(s.fn) for s in specs]
        self.failure_totals: dict[str, Counter] = {n: Counter() for n in names}
        self._pool = None
        self._thread: _RewardThread | None = None
        # scores what submit() hands over, one submission at a time, in order; made at the first
        self._feeder: ThreadPoolExecutor | None = None
        if workers > 0:
            from moe_rl.rewards.pool import RewardPool

            self._pool = RewardPool(workers, timeout_s, functions=sorted({s.fn for s in specs}))
        else:  # while the run builds its model
            self._thread = _RewardThread()
            self._thread.submit([(warm_up, fn, {}) for fn in self._fns], WARM_UP_TIMEOUT_S)

    def score(self, samples: Sequence[RewardInput]) -> RewardBatch:
        """Every reward of every sample: in worker processes (``workers > 0``, in parallel,
        a hung call's worker killed at the timeout), or one call at a time in a thread."""
        if self._feeder is not None:  # scoring has begun on the feeder: it keeps the thread or pool to itself
            return self.gather([self.submit(samples)])
        return self._table(self._outcomes(samples))

    def submit(self, samples: Sequence[RewardInput]) -> Future[list[list[Outcome]]]:
        """Start scoring ``samples`` in the background and return at once (e.g. a group whose
        responses are done while others still generate); :meth:`gather` collects them.
        Submissions are scored one after another, each exactly as :meth:`score` would."""
        if self._feeder is None:
            self._feeder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-reward-feed")
        return self._feeder.submit(self._outcomes, list(samples))

    def gather(self, pending: Sequence[Future[list[list[Outcome]]]]) -> RewardBatch:
        """The rewards of the samples of every submission in ``pending``, in that order:
        the table :meth:`score` gives for all of them at once (failures counted alike)."""
        parts = [p.result() for p in pending]
        return self._table([[o for part in parts for o in part[k]] for k in range(len(self.specs))])

    def _outcomes(self, samples: Sequence[RewardInput]) -> list[list[Outcome]]:
        """Each reward's (value, failure kind) for each sample: ``[reward][sample]``."""
        if self._pool is not None:
            tasks = [(spec.fn, spec.kwargs, sample) for spec in self.specs for sample in samples]
            outcomes = iter(self._pool.score(tasks))
        else:
            outcomes = self._call_all(
                [(fn, sample, spec.kwargs) for spec, fn in zip(self.specs, self._fns) for sample in samples]
            )
        return [[next(outcomes) for _ in samples] for _ in self.specs]

    def _table(self, outcomes: list[list[Outcome]]) -> RewardBatch:
        """The reward table of ``outcomes`` (``[reward][sample]``), conditionals applied;
        failures counted (the first of each kind per reward logged)."""
        columns: list[list[float]] = []
        failures: dict[str, Counter] = {n: Counter() for n in self.names}
        for spec, column_outcomes in zip(self.specs, outcomes):
            column = []
            for value, failure in column_outcomes:
                if failure is not None:
                    failures[spec.name][failure] += 1
                    if self.failure_totals[spec.name][failure] == 0:
                        log.warning(
                            "reward %r: %s on a sample (scored 0; counted, further ones not logged)", spec.name, failure
                        )
                    self.failure_totals[spec.name][failure] += 1
                column.append(value)
            columns.append(column)
        # one tensor for the table (an element assignment per value cost more than a cached rule reward)
        values = torch.tensor(columns, dtype=torch.float32).T.contiguous()  # [samples, rewards]
        for c in self.conditionals:
            values = conditional_reward(values, self.names.index(c.target), self.names.index(c.condition), c.threshold)
        return RewardBatch(values=values, names=list(self.names), weights=list(self.weights), failures=failures)

    def _call_all(self, calls: list[tuple[RewardFn, RewardInput, dict]]) -> Iterator[Outcome]:
        """Each call's (value, failure kind), in order, run one at a time on the scorer's
        reward thread. The calls are queued together and this thread sleeps until all have
        run (one hand-off and one wake-up per batch: a wake-up per call cost more than the
        calls of a cached rule reward); each call gets ``timeout_s`` from when the one before
        it ended (the first: from when the thread took the batch, after the rewards'
        warm-up). A call past it scores a timeout, and the thread, still busy with it, is
        left behind: a fresh one runs the rest."""
        while calls:
            if self._thread is None:
                self._thread = _RewardThread()
            batch = self._thread.submit(calls, self.timeout_s)
            late = self._thread.wait(batch)
            ran = len(batch.calls) if late is None else max(late, 0)  # the calls that finished
            for call in batch.calls[:ran]:
                yield call.outcome()
            if late is None:
                return
            self._thread.abandon()
            self._thread = None
            if late < 0:  # still warming up: none of these ran
                log.warning(
                    "a reward's warm-up ran past %g s; left behind, the rewards run without it", WARM_UP_TIMEOUT_S
                )
                continue
            yield 0.0, "timeout"
            calls = calls[late + 1 :]

    def close(self) -> None:
        """Stop the feeder thread and the worker processes (if any)."""
        if self._feeder is not None:
            self._feeder.shutdown(wait=True, cancel_futures=True)
            self._feeder = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


@dataclass
class _PendingCall:
    """One reward call queued on a :class:`_RewardThread`; ``value`` or ``error`` once it ran."""

    fn: Callable[..., Any]  # a reward function (or, at the start, :func:`warm_up`)
    sample: Any  # its first argument: a RewardInput (for warm_up: the reward function)
    kwargs: dict
    value: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn(self.sample, **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - any failure of user code scores 0
            self.error = e

    def outcome(self) -> tuple[float, str | None]:
        if self.error is not None:
            log.debug("reward function raised: %r", self.error)
            return 0.0, "error"
        return reward_outcome(self.value)


class _Batch:
    """Calls queued together on a :class:`_RewardThread`, run in order; each may run
    ``timeout_s`` from when the one before it ended."""

    def __init__(self, calls: list[_PendingCall], timeout_s: float) -> None:
        self.calls, self.timeout_s = calls, timeout_s
        self.ended = 0  # calls that have run
        self.done = threading.Event()  # every call ran


class _RewardThread:
    """One daemon thread that runs batches of reward calls in turn (a thread per call cost
    more than a rule reward itself). A call past its timeout leaves the thread behind
    (:meth:`abandon`: the calls queued after it are dropped) and a new one takes over: the
    hung call cannot stall the step, but its thread is not stopped, and a call that holds the
    GIL (CPython's ``re``: a backtracking pattern) blocks the waiting thread too, so its
    timeout ends only when the call does: ``reward.workers`` kills such a call."""

    def __init__(self) -> None:
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._abandoned = threading.Event()
        self._running: _Batch | None = None  # the batch whose call runs now
        self._call_started = time.monotonic()  # when its running call started
        threading.Thread(target=self._serve, daemon=True, name="moe-rl-reward").start()

    def _serve(self) -> None:
        while not self._abandoned.is_set():
            batch = self._batches.get()
            self._call_started = time.monotonic()
            self._running = batch
            for call in batch.calls:
                if self._abandoned.is_set():
                    return
                call.run()
                self._call_started = time.monotonic()  # before the count: whoever sees the count sees this
                batch.ended += 1
            self._running = None
            batch.done.set()

    def submit(self, calls: list[tuple[Callable, Any, dict]], timeout_s: float) -> _Batch:
        """Queue ``calls`` (run in order, after any batch queued before)."""
        batch = _Batch([_PendingCall(fn, sample, kwargs) for fn, sample, kwargs in calls], timeout_s)
        self._batches.put(batch)
        return batch

    def wait(self, batch: _Batch) -> int | None:
        """Sleep until every call of ``batch`` ran (``None``), or until the running call has
        run past its batch's timeout: its index in ``batch``, or -1 when it belongs to a
        batch ahead of it (the warm-up). Wakes only when the batch is done or a running
        call's time is up."""
        waited_from = time.monotonic()
        while not batch.done.is_set():
            running = self._running
            ended = batch.ended
            started = max(self._call_started, waited_from)
            deadline = started + (running or batch).timeout_s
            if time.monotonic() >= deadline and running is not None:
                return ended if running is batch else -1
            # behind another batch: look again soon (its end starts this batch's clock)
            wake = deadline if running is batch else min(deadline, time.monotonic() + 0.05)
            batch.done.wait(max(wake - time.monotonic(), 0.001))
        return None

    def abandon(self) -> None:
        """Drop what is queued behind the running call; the thread ends after it."""
        self._abandoned.set()
