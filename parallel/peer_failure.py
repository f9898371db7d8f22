"""One rank's failure stops every rank, within seconds, naming it.

Ranks wait in collectives for work one rank does alone: the first rank collects the
rollouts, evaluates and commits checkpoints while the others wait in the next collective.
If that rank raises, the others would wait there until ``train.collective_timeout_min``
(3 hours by default) holding their GPUs: a launcher stops the ranks of the node where a
process exited, but the DeepSpeed launcher does not stop other nodes'.

So a rank that fails writes its error to the job's store (the TCPStore at
``MASTER_ADDR:MASTER_PORT`` that ``init_process_group`` made; the first writer's error is
kept), and every rank watches that key from a thread: a rank that sees it prints one line
naming the failed rank and its error and exits with :data:`PEER_FAILED_EXIT` (it cannot
leave a collective any other way). The failed rank keeps its process, and with it the
store it may host, until every rank has seen the error (at most :data:`SEEN_WAIT_S`).

A job whose store stops answering (its host, the first rank's process, is gone without
saying why: killed, out of memory) is stopped the same way after :data:`STORE_LOST_S`.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import Callable, TextIO

import torch.distributed as dist

PEER_FAILED_EXIT = 4  # a rank stopped because another failed (launchers: not the job's cause)
POLL_S = 2.0  # how often each rank reads the store (512 reads/s on its host at 1,024 ranks)
STORE_LOST_S = 30.0  # the store unreachable this long while the run goes on: stop
SEEN_WAIT_S = 30.0  # how long a failed rank keeps its process for the others to see its error

_FAILED = "moe_rl/failed"  # the first failure's line
_SEEN = "moe_rl/failure_seen"  # how many ranks have seen it, or failed themselves


class PeerWatch:
    """A thread that stops this rank when another rank has failed (see the module)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: dist.Store,
        *,
        poll_s: float = POLL_S,
        store_lost_s: float = STORE_LOST_S,
        exit_process: Callable[[int], None] = os._exit,
        err: TextIO | None = None,
    ) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.poll_s, self.store_lost_s = poll_s, store_lost_s
        self.exit_process = exit_process
        self.err = err
        self.announced = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moe-rl-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (idempotent): this rank is done, or failing on its own."""
        self._stopped.set()

    def announce(self, error: BaseException) -> None:
        """This rank failed with ``error``: stop watching, and tell the others (the first
        failure's line is the one they print). Never raises: it runs while failing."""
        self.stop()
        if self.announced:
            return
        self.announced = True
        line = f"rank {self.rank} ({socket.gethostname()}) failed: {_one_line(error)}"
        try:
            self.store.compare_set(_FAILED, "", line)
            self.store.add(_SEEN, 1)
        except Exception:  # noqa: BLE001 - the store is gone too: nothing to tell
            self.announced = False

    def wait_until_seen(self, timeout_s: float = SEEN_WAIT_S) -> None:
        """After :meth:`announce`: return once every rank has seen a failure (or failed
        itself), the store is gone, or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while self.announced and time.monotonic() < deadline:
            try:
                if self.store.add(_SEEN, 0) >= self.world_size:
                    return
            except Exception:  # noqa: BLE001 - its host has exited: no one is left to read it
                return
            time.sleep(0.1)

    def _watch(self) -> None:
        lost_since: float | None = None
        while not self._stopped.wait(self.poll_s):
            try:
                failed = self.store.check([_FAILED])
                line = self.store.get(_FAILED).decode() if failed else None
                lost_since = None
            except Exception as e:  # noqa: BLE001 - DistNetworkError and what a closing store raises
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since < self.store_lost_s:
                    continue
                line = f"the job's store stopped answering {self.store_lost_s:.0f}s ago ({_one_line(e)})"
            if line is not None and not self._stopped.is_set():
                self._stop_process(line)
                return

    def _stop_process(self, line: str) -> None:
        print(f"moe-rl: rank {self.rank} stops: {line}", file=self.err or sys.stderr, flush=True)
        try:
            self.store.add(_SEEN, 1)
        except Exception:  # noqa: BLE001
            pass
        self.exit_process(PEER_FAILED_EXIT)


def _one_line(error: BaseException, limit: int = 1000) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_WATCH: PeerWatch | None = None


def start_peer_watch(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Start this process's watch (several ranks only; idempotent), on a store client of
    its own: the process group's client may block in a ``get`` while a communicator forms."""
    global _WATCH
    if world_size < 2 or _WATCH is not None:
        return
    store = dist.TCPStore(
        master_addr, master_port, None, False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    _WATCH = PeerWatch(rank, world_size, store).start()


def announce_failure(error: BaseException) -> None:
    """This rank failed on its own (not a stop every rank makes together): the others stop
    too. Not for a ``KeyboardInterrupt`` (Ctrl-C and stop requests reach every rank, which
    then save together); without a watch (one process): nothing."""
    if _WATCH is not None and not isinstance(error, KeyboardInterrupt):
        _WATCH.announce(error)


def stop_peer_watch() -> None:
    """Before the process group goes: a rank that announced its failure first waits for
    the others to see it (its process may host their store)."""
    global _WATCH
    if _WATCH is None:
        return
    watch, _WATCH = _WATCH, None
    watch.stop()
    watch.wait_until_seen()
