"""Start N local processes with the launcher environment (like torchrun), for
``--nproc N`` conveniences and tests. Multi-node jobs use the DeepSpeed launcher or
torchrun, which set the same variables."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator, Sequence

from parallel.peer_failure import PEER_FAILED_EXIT, SEEN_WAIT_S

STOP_GRACE_S = 10.0  # after a rank fails: how long the others get to exit on their own, then to exit on SIGTERM

# exec'd in the child: set the parent-death signal, check the parent still lives, exec the command
# (a stub rather than preexec_fn, which is unsafe to fork from a multi-threaded trainer)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dies_with_this_process(command: Sequence[str]) -> list[str]:
    """``command`` wrapped so that it gets SIGTERM when this process dies, even by
    ``kill -9`` (Linux ``PR_SET_PDEATHSIG``, set by a small exec stub); unchanged elsewhere.
    Its ``/proc/<pid>/cmdline`` is ``command`` once it runs. Start it from the main thread
    (the signal follows the thread that started the child)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def die_with_parent(parent: int) -> None:
    """Called in a just-started child process of ``parent`` (a ``multiprocessing``
    initializer, ``initargs=(os.getpid(),)``): it gets SIGTERM when the parent dies, even by
    ``kill -9`` (Linux only; start it from the main thread: the signal follows the thread
    that started the child). As :func:`dies_with_this_process` does for commands."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was set
            os._exit(1)


def spawn_local(
    nproc: int,
    argv: Sequence[str],
    *,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``python argv...`` in ``nproc`` processes (ranks 0..N-1) and wait.

    Returns 0 when all succeed, else the first non-zero exit code. A rank that fails
    stops the job: one line names it and its exit status, the others get
    :data:`STOP_GRACE_S` to exit on their own (peers of a dead rank usually fail fast),
    then SIGTERM, then SIGKILL (each rank's whole process group). The ranks run in their
    own session and die with the launcher; a Ctrl-C or SIGTERM to the launcher reaches each
    rank exactly once (the trainer checkpoints on the first and stops at once on the second).
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    port = free_port()
    procs = []
    for rank in range(nproc):
        child_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        command = dies_with_this_process([sys.executable, *argv])
        procs.append(subprocess.Popen(command, env=child_env, start_new_session=True))
    with _forward_signals(procs):  # during the stop too: a second Ctrl-C reaches the ranks
        try:
            return _wait(procs, None if timeout_s is None else time.monotonic() + timeout_s, timeout_s)
        finally:
            _stop(procs)


def _wait(procs: list[subprocess.Popen], deadline: float | None, timeout_s: float | None) -> int:
    """The job's exit code: 0, the first failing rank's code, or 124 past the deadline. A
    rank that stopped because another failed (:data:`PEER_FAILED_EXIT`) is not the cause:
    the failed rank exits once its peers have seen its error, and its code is the job's."""
    followers_since: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        # a rank killed by a signal is the likelier cause when several are seen failed at once
        failed = sorted((code > 0, rank, code) for rank, code in enumerate(codes) if code not in (None, 0))
        causes = [f for f in failed if f[2] != PEER_FAILED_EXIT]
        if failed and not causes and None in codes:  # the failed rank is still telling the others
            followers_since = followers_since or time.monotonic()
            if time.monotonic() - followers_since < SEEN_WAIT_S + STOP_GRACE_S:
                failed = []
        failed = causes or failed
        if failed:
            _, rank, code = failed[0]
            if code not in (2, 130):  # 2: an error the rank reported, 130: stopped on request (Ctrl-C)
                print(f"[moe-rl] rank {rank} {_exit_status(code)}: stopping the job", file=sys.stderr, flush=True)
            return code
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            print(
                f"[moe-rl] processes still running after {timeout_s:.0f}s: stopping them", file=sys.stderr, flush=True
            )
            return 124
        time.sleep(0.1)


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs: list[subprocess.Popen]) -> None:
    """Give running ranks the grace period, then SIGTERM, then SIGKILL (their process groups)."""
    for signum in (None, signal.SIGTERM, signal.SIGKILL):
        running = [p for p in procs if p.poll() is None]
        if not running:
            return
        for p in running:
            if signum is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signum)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in running):
            time.sleep(0.1)


@contextlib.contextmanager
def _forward_signals(procs: list[subprocess.Popen]) -> Iterator[None]:
    """SIGINT/SIGTERM to this process are passed on to every running rank."""

    def forward(signum, frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: signals stay as they are
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
