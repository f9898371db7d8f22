"""Asynchronous rollouts (``rollout.async_rollouts``): the next step's experience is
collected in a thread on the first rank while this step trains, as slime's train_async
does. Its samples come from the weights before this step's update (one version behind);
the trainer waits for it before it syncs new weights into the engine, so no sample ever
mixes two versions. The thread runs no collective and no megatron code."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from moe_rl.experience.collector import ExperienceCollector


class BackgroundRollout:
    """At most one step's collection in flight; its result is kept until taken."""

    def __init__(self, collector: ExperienceCollector) -> None:
        self.collector = collector
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def start(self, step: int) -> None:
        """Collect step ``step``'s experience from the weights the engine serves now, in a
        daemon thread: a run that stops (a crash, an interrupt) exits without waiting for it,
        where an executor's thread would be joined at exit, the whole collection long."""
        if self._pending is not None:
            raise RuntimeError(f"step {self._pending[0] + 1}'s rollout is still pending")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def collect() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self.collector.collect(step))
            except BaseException as e:  # noqa: BLE001 - handed to whoever takes the result
                future.set_exception(e)

        threading.Thread(target=collect, daemon=True, name="moe-rl-rollout").start()
        self._pending = (step, future)

    def wait(self) -> None:
        """Block until the pending collection (if any) ends; the engine is idle afterwards.
        A collection that failed raises here."""
        if self._pending is not None:
            self._pending[1].result()

    def take(self, step: int) -> tuple[Any, dict[str, float]] | None:
        """Step ``step``'s experience if it was started, else ``None``."""
        if self._pending is None or self._pending[0] != step:
            return None
        _, future = self._pending
        self._pending = None
        return future.result()

    def close(self) -> None:
        """Drop a pending collection (an interrupted run) without waiting for it."""
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None
