"""Ctrl-C and SIGTERM ask a run to stop after the current step (every rank agrees)."""

from __future__ import annotations

import logging
import signal
from typing import Any

from parallel.collectives import any_rank

log = logging.getLogger("moe_rl.train")


class StopRequests:
    """While entered, SIGINT/SIGTERM set a flag instead of killing the process; a second
    Ctrl-C stops at once. :meth:`requested` is collective."""

    def __init__(self) -> None:
        self._flag = False
        self._previous: dict[int, Any] = {}  # signal.signal's previous handlers

    def __enter__(self) -> StopRequests:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self._flag:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._flag = True
        log.warning("stop requested (signal %d): finishing this step and saving a checkpoint", signum)

    def requested(self) -> bool:
        """True on every rank when any rank was asked to stop."""
        return any_rank(self._flag)
