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
A rank gone without saying why elsewhere (killed, out of memory, its node lost) is found by
the heartbeats: every rank counts its own up in the store at each poll and watches the next
rank's (a ring: two store reads per rank and poll, whatever the world size); one that has not
moved for :data:`SILENT_S` is announced as failed by the rank watching it.
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
POLL_S = 2.0  # how often each rank reads and beats (~1,500 store requests/s on its host at 1,024 ranks)
STORE_LOST_S = 30.0  # the store unreachable this long while the run goes on: stop
SEEN_WAIT_S = 30.0  # how long a failed rank keeps its process for the others to see its error
SILENT_S = 120.0  # a rank whose heartbeat has not moved this long is taken for gone (killed, out of memory)

_FAILED = "moe_rl/failed"  # the first failure's line
_SEEN = "moe_rl/failure_seen"  # how many ranks have seen it, or failed themselves
_BEAT = "moe_rl/beat/{}"  # a rank's heartbeat count
_DONE = "moe_rl/done/{}"  # set once a rank stopped watching on purpose (its run ended, or it failed and said so)
_HOST = "moe_rl/host/{}"  # a rank's host name (for the line naming it)


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
        silent_s: float = SILENT_S,
        exit_process: Callable[[int], None] = os._exit,
        err: TextIO | None = None,
    ) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.poll_s, self.store_lost_s, self.silent_s = poll_s, store_lost_s, silent_s
        self.exit_process = exit_process
        self.err = err
        self.announced = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moe-rl-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        try:
            self.store.set(_HOST.format(self.rank), socket.gethostname())
        except Exception:  # noqa: BLE001 - the watch reports a store that does not answer
            pass
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and beating (idempotent): this rank is done, or failing on its own;
        the rank watching it is told not to take its silence for a death."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self.store.set(_DONE.format(self.rank), "1")
        except Exception:  # noqa: BLE001 - the store is gone: no one is left to watch
            pass

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
        watched = _Heartbeat((self.rank + 1) % self.world_size)
        while not self._stopped.wait(self.poll_s):
            try:
                self.store.add(_BEAT.format(self.rank), 1)
                failed = self.store.check([_FAILED])
                line = self.store.get(_FAILED).decode() if failed else self._silence(watched)
                lost_since = None
            except Exception as e:  # noqa: BLE001 - DistNetworkError and what a closing store raises
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since < self.store_lost_s:
                    continue
                line = f"the job's store stopped answering {self.store_lost_s:.0f}s ago ({_one_line(e)})"
            if line is not None and not self._stopped.is_set():
                self._stop_process(line)
                return

    def _silence(self, watched: _Heartbeat) -> str | None:
        """The failure line for the watched rank when its heartbeat has stood still for
        ``silent_s`` and it did not stop on purpose (announced, so every rank stops with it)."""
        if not watched.stalled(self.store.add(_BEAT.format(watched.rank), 0), self.silent_s):
            return None
        if self.store.check([_DONE.format(watched.rank)]):
            return None
        key = _HOST.format(watched.rank)
        host = self.store.get(key).decode() if self.store.check([key]) else "host unknown"
        line = f"rank {watched.rank} ({host}) stopped answering {self.silent_s:.0f}s ago (killed? out of memory?)"
        self.store.compare_set(_FAILED, "", line)
        return self.store.get(_FAILED).decode()

    def _stop_process(self, line: str) -> None:
        print(f"moe-rl: rank {self.rank} stops: {line}", file=self.err or sys.stderr, flush=True)
        try:
            self.store.add(_SEEN, 1)
        except Exception:  # noqa: BLE001
            pass
        self.exit_process(PEER_FAILED_EXIT)


class _Heartbeat:
    """Another rank's heartbeat as this rank sees it: when its count last moved (this
    rank's clock: no two hosts' clocks are compared)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.count: int | None = None
        self.moved = time.monotonic()

    def stalled(self, count: int, limit_s: float) -> bool:
        """Whether ``count`` (read now) has not moved for ``limit_s``."""
        now = time.monotonic()
        if count != self.count:
            self.count, self.moved = count, now
        return now - self.moved >= limit_s


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
