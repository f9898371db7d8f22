"""Start and stop SGLang servers (``python -m sglang.launch_server``), or attach to
servers a user already runs. Logs go to the run directory."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, cast

from moe_rl.rollout.types import RolloutError
from parallel.launch import dies_with_this_process


# How SGLang 0.5.23 serves without a GPU (docs/sglang.md): its plain-torch attention and
# sampling, no overlap scheduler (it assumes CUDA streams), no warm-up request, and a
# scheduler that sleeps when idle (else it spins a whole core beside the trainer, which
# starves a 2-core machine's training steps). A small KV pool: host memory is shared
# with the trainer. Flags in ServerSettings.extra_args come later and win.
CPU_SERVER_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-overlap-schedule",
    "--skip-server-warmup",
    "--sleep-on-idle",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "16",
)
CPU_SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


@dataclass
class ServerSettings:
    model_path: str
    port: int = 30000
    host: str = "127.0.0.1"
    tp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float = 0.8
    return_routed_experts: bool = False
    deterministic: bool = False
    seed: int = 0
    gpus: tuple[int, ...] | None = None  # CUDA_VISIBLE_DEVICES of the server (None: inherited)
    memory_saver: bool = False  # --enable-memory-saver: it can release its GPU memory (colocated trainer)
    device: str = "cuda"  # cuda | cpu (CPU_SERVER_ARGS; --enable-deterministic-inference needs CUDA)
    extra_args: list[str] = field(default_factory=list)
    launch_command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "sglang.launch_server"])

    def command(self) -> list[str]:
        cmd = [
            *self.launch_command,
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tp-size",
            str(self.tp_size),
            "--ep-size",
            str(self.ep_size),
            "--mem-fraction-static",
            str(self.mem_fraction_static),
            "--random-seed",
            str(self.seed),
        ]
        if self.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if self.deterministic and self.device == "cuda":
            cmd.append("--enable-deterministic-inference")
        if self.memory_saver:
            cmd.append("--enable-memory-saver")
        if self.device == "cpu":
            cmd.extend(CPU_SERVER_ARGS)
        return cmd + list(self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.device == "cpu":
            env.update(CPU_SERVER_ENV)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        return env


def check_server_gpus(server_gpus: Sequence[int | str], trainer_gpus: Sequence[int | str]) -> None:
    """A launched server must not share the GPUs this node's trainer ranks use (it would
    land on them and both would run out of memory): ``ValueError`` naming both."""
    if not trainer_gpus:
        return  # no GPUs on this machine
    if not server_gpus:
        raise ValueError(
            f"rollout.server.launch on a GPU machine needs rollout.server.gpus (GPUs for SGLang); the trainer uses GPUs "
            f"{list(trainer_gpus)} on this node"
        )
    shared = sorted(set(map(str, server_gpus)) & set(map(str, trainer_gpus)))
    if shared:
        raise ValueError(
            f"rollout.server.gpus={list(server_gpus)} overlaps the trainer's GPUs {list(trainer_gpus)} on this node: {shared}"
        )


def _check_port_free(host: str, port: int) -> None:
    """A server already listening there would answer our health checks instead (and be
    adopted silently): refuse."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            raise RolloutError(
                f"port {port} on {host} is already in use (another server?): choose another rollout.server.port"
            ) from None


class SGLangServer:
    """One server process we started; ``stop()`` (or the context manager) ends it.

    It never outlives its owner: ``stop()`` runs at interpreter exit too, the server gets
    SIGTERM when the owner dies (even by ``kill -9``: a parent-death signal), and
    ``log_dir/sglang-<port>.pid`` lets the next start on that port stop a server an
    earlier owner left behind (it checks the process is that server: same command line).
    """

    def __init__(self, settings: ServerSettings, log_dir: str | os.PathLike) -> None:
        self.pid_path = Path(log_dir) / f"sglang-{settings.port}.pid"
        stop_stale_server(self.pid_path)
        _check_port_free(settings.host, settings.port)
        self.settings = settings
        self._nccl_version: str | None | object = _NOT_ASKED
        self.log_path = Path(log_dir) / f"sglang-{settings.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        command = settings.command()
        self.process = subprocess.Popen(
            dies_with_this_process(command),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=settings.environment(),
        )
        self.pid_path.write_text(json.dumps({"pid": self.process.pid, "command": command}))
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return self.settings.url

    def nccl_version(self) -> str | None:
        """The NCCL version of the server's python (its torch's, which its weight-update
        groups use), ``None`` when it cannot tell (no NCCL in that torch); asked once."""
        if self._nccl_version is _NOT_ASKED:
            self._nccl_version = python_nccl_version(self.settings.launch_command[0], self.settings.environment())
        return cast("str | None", self._nccl_version)

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Wait on ``/health_generate``; fail at once if the process dies (with its log tail)."""
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RolloutError(
                    f"SGLang server exited with code {self.process.returncode}; log tail:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health_generate", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutError(
                    f"SGLang server on {self.url} not healthy after {timeout_s:.0f}s (rollout.server.start_timeout_s); "
                    f"log {self.log_path}, its tail:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the server's process group (SIGTERM, SIGKILL after ``timeout_s``); idempotent."""
        atexit.unregister(self.stop)
        _kill_group(
            self.process.pid, timeout_s, wait=self.process.wait
        )  # its workers too, if the server itself is gone
        self.pid_path.unlink(missing_ok=True)
        self._log.close()

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_NOT_ASKED = object()
_NCCL_VERSION_SCRIPT = (
    "import torch\n"
    "try:\n"
    "    print('.'.join(str(p) for p in torch.cuda.nccl.version() if p != ''))\n"
    "except (AttributeError, RuntimeError):\n"
    "    pass\n"
)


def python_nccl_version(python: str, env: dict[str, str] | None = None, timeout_s: float = 120.0) -> str | None:
    """``torch.cuda.nccl.version()`` as ``"2.27.7"`` in the interpreter ``python``; ``None``
    where that torch has no NCCL or the interpreter does not answer."""
    try:
        done = subprocess.run(
            [python, "-c", _NCCL_VERSION_SCRIPT], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def stop_stale_server(pid_path: Path, timeout_s: float = 30.0) -> None:
    """Stop the server ``pid_path`` records if it still runs (and still is that server:
    its command line matches); remove the file."""
    try:
        record = json.loads(pid_path.read_text())
        pid, command = int(record["pid"]), list(record["command"])
    except (OSError, ValueError, KeyError, TypeError):
        pid_path.unlink(missing_ok=True)
        return
    if _command_line(pid) == command:
        print(f"moe-rl: stopping SGLang server pid {pid} that an earlier run left behind ({pid_path})", file=sys.stderr)
        _kill_group(pid, timeout_s)  # it leads its own process group (started in a new session)
    pid_path.unlink(missing_ok=True)


def _command_line(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1] or None  # empty: exiting or exited


def _running(pid: int) -> bool:
    """Not yet fully exited: a zombie whose last thread is gone has closed its sockets."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    state, threads = fields[0], int(fields[17])
    return state not in ("Z", "X") or threads > 1


def _kill_group(pgid: int, timeout_s: float, wait=None) -> None:
    """SIGTERM the process group ``pgid`` (a server and its workers), SIGKILL what is left
    after ``timeout_s``. ``wait``: reaps the leader when it is this process's child."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _group_running(pgid, wait):
            time.sleep(0.1)
        if not _group_running(pgid, wait):
            break
    if wait is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            wait(timeout=5)


def _group_running(pgid: int, wait=None) -> bool:
    """Some process of the group still runs (exited leaders reaped when ours, zombies ignored)."""
    if wait is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            wait(timeout=0)
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return any(_running(pid) for pid in members)
