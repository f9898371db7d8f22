"""Asynchronous rollouts (``rollout.async_rollouts``): the next step's experience is
collected in a thread on the first rank while this step trains, as slime's train_async
does. Its samples come from the weights before this step's update (one version behind);
the trainer waits for it before it syncs new weights into the engine, so no sample ever
mixes two versions. The thread runs no collective and no megatron code."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from moe_rl.experience.collector import ExperienceCollector


class BackgroundRollout:
    """At most one step's collection in flight; its result is kept until taken."""

    def __init__(self, collector: ExperienceCollector) -> None:
        self.collector = collector
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-rollout")
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def start(self, step: int) -> None:
        """Collect step ``step``'s experience from the weights the engine serves now."""
        if self._pending is not None:
            raise RuntimeError(f"step {self._pending[0] + 1}'s rollout is still pending")
        self._pending = (step, self._pool.submit(self.collector.collect, step))

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
        self._pool.shutdown(wait=False, cancel_futures=True)
