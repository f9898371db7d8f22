"""One rank's failure stops the others (parallel/peer_failure.py): the watch on the job's
store, in process; and across real processes waiting in a gloo collective."""

from __future__ import annotations

import datetime
import io
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from conftest import SUPPORT
from parallel.peer_failure import PEER_FAILED_EXIT, PeerWatch


def _store_pair() -> tuple[dist.TCPStore, dist.TCPStore]:
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timeout, wait_for_workers=False)
    return server, client


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_watching_rank_stops_on_the_first_failure_announced_and_the_failed_rank_hears_it_was_seen() -> None:
    server, client = _store_pair()
    exits: list[int] = []
    err = io.StringIO()
    waiting = PeerWatch(1, 3, client, poll_s=0.05, exit_process=exits.append, err=err).start()
    failed = PeerWatch(0, 3, server, poll_s=0.05, exit_process=exits.append)
    second = PeerWatch(2, 3, server, poll_s=0.05, exit_process=exits.append)
    failed.announce(RuntimeError("the rollout\nserver went away"))
    second.announce(ValueError("a later failure"))  # the first one's line is kept
    _wait_for(lambda: exits)
    assert exits == [PEER_FAILED_EXIT]
    line = err.getvalue()
    assert line.startswith("moe-rl: rank 1 stops: rank 0 (") and line.endswith(
        "failed: RuntimeError: the rollout server went away\n"
    ), line
    start = time.monotonic()
    failed.wait_until_seen(timeout_s=5)  # the two that failed and the one that saw it
    assert time.monotonic() - start < 1
    waiting.stop()


def test_a_rank_failing_itself_is_not_stopped_by_its_own_watch_nor_by_a_stopped_one() -> None:
    server, client = _store_pair()
    exits: list[int] = []
    own = PeerWatch(0, 2, server, poll_s=0.05, exit_process=exits.append).start()
    done = PeerWatch(1, 2, client, poll_s=0.05, exit_process=exits.append).start()
    done.stop()  # finished its run
    own.announce(RuntimeError("boom"))
    time.sleep(0.3)
    assert exits == []
    start = time.monotonic()
    own.wait_until_seen(timeout_s=0.5)  # rank 1 never saw it: the wait ends at its limit
    assert 0.4 < time.monotonic() - start < 2


def test_a_rank_gone_without_a_word_is_announced_by_the_rank_watching_its_heartbeat() -> None:
    """Rank 1 never beats (killed, its node lost): rank 0, which watches it, announces it
    after the silence limit, and rank 2 (watching rank 0, alive) stops with the same line; a
    rank that stopped on purpose (its run ended) is never taken for dead."""
    server, client = _store_pair()
    exits: list[int] = []
    errs = [io.StringIO(), io.StringIO()]
    start = time.monotonic()  # (before the watch: its clock starts at its first poll, later)
    watcher = PeerWatch(0, 3, server, poll_s=0.05, silent_s=0.4, exit_process=exits.append, err=errs[0]).start()
    other = PeerWatch(2, 3, client, poll_s=0.05, silent_s=0.4, exit_process=exits.append, err=errs[1]).start()
    _wait_for(lambda: len(exits) == 2)
    assert time.monotonic() - start >= 0.4 and exits == [PEER_FAILED_EXIT] * 2
    assert (
        errs[0].getvalue()
        == "moe-rl: rank 0 stops: rank 1 (host unknown) stopped answering 0s ago (killed? out of memory?)\n"
    )
    assert errs[1].getvalue() == errs[0].getvalue().replace("rank 0 stops", "rank 2 stops")
    watcher.stop(), other.stop()
    server, client = _store_pair()
    exits.clear()
    watcher = PeerWatch(0, 2, server, poll_s=0.05, silent_s=0.3, exit_process=exits.append).start()
    finished = PeerWatch(1, 2, client, poll_s=0.05, silent_s=0.3, exit_process=exits.append).start()
    time.sleep(0.2)
    finished.stop()
    time.sleep(0.8)
    assert exits == []
    watcher.stop()


def test_a_store_that_stops_answering_stops_the_rank_after_its_grace() -> None:
    server, client = _store_pair()
    exits: list[int] = []
    err = io.StringIO()
    watch = PeerWatch(1, 2, client, poll_s=0.05, store_lost_s=0.5, exit_process=exits.append, err=err).start()
    time.sleep(0.2)
    assert exits == []  # answering: nothing
    lost = time.monotonic()
    del server  # the first rank's process, which hosted it, is gone
    _wait_for(lambda: exits)
    assert time.monotonic() - lost >= 0.5
    assert exits == [PEER_FAILED_EXIT] and "the job's store stopped answering" in err.getvalue()
    watch.stop()


@pytest.mark.distributed
@pytest.mark.parametrize("failing", [0, 1])  # 0 hosts the store
def test_a_rank_failing_alone_stops_the_rank_waiting_for_it_in_a_collective(failing: int) -> None:
    launcher = (
        "import sys; from parallel.launch import spawn_local; "
        f"sys.exit(spawn_local(2, [{str(SUPPORT / 'peer_failure_worker.py')!r}, '{failing}'], timeout_s=100))"
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=150)
    waited = time.monotonic() - start
    other = 1 - failing
    # the failed rank's own code, not the waiting rank's (4), nor the launcher's stop (124)
    assert out.returncode == 3, out.stderr[-3000:]
    assert f"moe-rl: rank {other} stops: rank {failing} (" in out.stderr, out.stderr[-3000:]
    assert f"failed: RuntimeError: the rollout server of rank {failing} went away" in out.stderr
    assert f"[moe-rl] rank {failing} exited with code 3: stopping the job" in out.stderr  # not the waiting one
    assert f"rank {other} exited" not in out.stderr
    assert waited < 60  # the collective's own timeout is 10 minutes
