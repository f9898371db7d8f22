"""Reward functions scored in worker processes, in parallel, with a hard per-sample timeout.

A task is ``(function name, kwargs, RewardInput)``; a worker resolves the name (a
registered reward or ``module:function``) once and keeps it. A task that runs past the
timeout gets its worker killed (SIGKILL) and replaced, so a hung reward (a regex that
backtracks forever, a sympy call that never returns) neither stalls the step nor leaves
a thread running. Workers are started with ``spawn`` (the trainer process has threads
and process groups, which ``fork`` would copy half-made) and wait until imported and warmed
up (``warm_up``: e.g. math-verify's first call) before the first task, so start-up never
counts against a task's time. A task that cannot be pickled (something in its input's
metadata) scores 0 as an error, as a failing reward does.
"""

from __future__ import annotations

import collections
import multiprocessing
import pickle
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from moe_rl.rewards.base import RewardInput, resolve_reward_fn, reward_outcome, warm_up

Task = tuple[str, dict[str, Any], RewardInput]
Outcome = tuple[float, str | None]  # (value, failure kind or None)
_STARTUP_S = 120.0


class RewardPool:
    """``workers`` processes that score :data:`Task` s; see the module doc."""

    def __init__(self, workers: int, timeout_s: float, functions: Sequence[str]) -> None:
        """``functions``: the reward names each worker imports before it is ready (a
        user module's import is never charged to a sample's time)."""
        if workers < 1:
            raise ValueError(f"a reward pool needs >= 1 worker, got {workers}")
        self.timeout_s = timeout_s
        self.functions = list(functions)
        self.restarts = 0  # workers killed (timeout) or lost (died) and replaced
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        for _ in range(workers):
            self._workers.append(self._spawn())
        for i in range(workers):
            self._await_ready(i)

    def _spawn(self) -> tuple[multiprocessing.process.BaseProcess, Connection]:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_serve, args=(child, self.functions), daemon=True, name="moe-rl-reward")
        process.start()
        child.close()
        return process, parent

    def _await_ready(self, i: int) -> None:
        process, conn = self._workers[i]
        try:  # (a worker that died at start closes its end: poll says ready, recv raises EOFError)
            ready = conn.poll(_STARTUP_S) and conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            process.join(timeout=1)
            how = f"exited with code {process.exitcode}" if process.exitcode is not None else "did not start"
            raise RuntimeError(
                f"reward worker {process.pid} {how} within {_STARTUP_S:.0f}s (its own error is above: a reward "
                "module that fails to import, or a script without an `if __name__ == '__main__':` guard)"
            )

    def _replace(self, i: int) -> None:
        process, conn = self._workers[i]
        process.kill()
        process.join()
        conn.close()
        self._workers[i] = self._spawn()
        self._await_ready(i)
        self.restarts += 1

    def score(self, tasks: Sequence[Task]) -> list[Outcome]:
        """Every task's outcome, in order; at most ``workers`` run at once."""
        outcomes: list[Outcome | None] = [None] * len(tasks)
        queue = collections.deque(enumerate(tasks))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (task, deadline)
        while queue or busy:
            for w in range(len(self._workers)):
                while w not in busy and queue:
                    index, task = queue.popleft()
                    try:
                        self._workers[w][1].send(task)  # pickled whole before anything is written
                    except (pickle.PicklingError, TypeError, AttributeError):
                        outcomes[index] = (0.0, "error")  # e.g. a lambda in the transcript's meta
                        continue
                    busy[w] = (index, time.monotonic() + self.timeout_s)
            if not busy:
                continue
            soonest = min(deadline for _, deadline in busy.values())
            ready = wait([self._workers[w][1] for w in busy], timeout=max(0.0, soonest - time.monotonic()))
            for w in list(busy):
                index, deadline = busy[w]
                conn = self._workers[w][1]
                if conn in ready or conn.poll():  # poll: answered while another worker was replaced
                    try:
                        outcomes[index] = conn.recv()
                    except (EOFError, OSError):  # the worker died (e.g. the function called os._exit)
                        outcomes[index] = (0.0, "error")
                        self._replace(w)
                    del busy[w]
                elif time.monotonic() >= deadline:
                    outcomes[index] = (0.0, "timeout")
                    self._replace(w)
                    del busy[w]
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        for process, conn in self._workers:
            process.kill()
            process.join()
            conn.close()
        self._workers = []


def _serve(conn: Connection, names: Sequence[str]) -> None:
    """A worker: import ``names``, announce readiness, then score tasks until the pipe closes."""
    from moe_rl.rewards import rules  # noqa: F401  (registers the built-in rewards)

    functions: dict[str, Any] = {name: resolve_reward_fn(name) for name in names}
    for fn in functions.values():  # before "ready": its time is never charged to a task's timeout
        warm_up(fn)
    conn.send("ready")
    while True:
        try:
            name, kwargs, sample = conn.recv()
        except (EOFError, OSError):
            return
        try:
            outcome = reward_outcome(functions[name](sample, **kwargs))
        except BaseException:  # noqa: BLE001 - any failure of user code scores 0
            outcome = (0.0, "error")
        conn.send(outcome)
