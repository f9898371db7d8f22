"""Start N local processes with the launcher environment (like torchrun), for
``--nproc N`` conveniences and tests. Multi-node jobs use the DeepSpeed launcher or
torchrun, which set the same variables."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(
    nproc: int,
    argv: Sequence[str],
    *,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``python argv...`` in ``nproc`` processes (ranks 0..N-1) and wait.

    Returns 0 when all succeed, else the first non-zero exit code; when one process
    fails or the timeout passes, the others are terminated (no hang on a dead peer).
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
        procs.append(subprocess.Popen([sys.executable, *argv], env=child_env))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"[moe-rl] processes still running after {timeout_s:.0f}s: stopping them", file=sys.stderr)
                return 124
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
