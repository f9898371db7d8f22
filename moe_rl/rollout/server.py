"""Start and stop SGLang servers (``python -m sglang.launch_server``), or attach to
servers a user already runs. Logs go to the run directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moe_rl.rollout.types import RolloutError


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
    extra_args: list[str] = field(default_factory=list)
    launch_command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "sglang.launch_server"])

    def command(self) -> list[str]:
        cmd = [
            *self.launch_command,
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--tp-size", str(self.tp_size),
            "--ep-size", str(self.ep_size),
            "--mem-fraction-static", str(self.mem_fraction_static),
            "--random-seed", str(self.seed),
        ]  # fmt: skip
        if self.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if self.deterministic:
            cmd.append("--enable-deterministic-inference")
        return cmd + list(self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class SGLangServer:
    """One server process we started; ``stop()`` (or the context manager) ends it."""

    def __init__(self, settings: ServerSettings, log_dir: str | os.PathLike) -> None:
        self.settings = settings
        self.log_path = Path(log_dir) / f"sglang-{settings.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            settings.command(), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def url(self) -> str:
        return self.settings.url

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Wait on ``/health_generate``; fail at once if the process dies (with its log tail)."""
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RolloutError(f"SGLang server exited with code {self.process.returncode}; log tail:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health_generate", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutError(f"SGLang server on {self.url} not healthy after {timeout_s:.0f}s; log: {self.log_path}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()

    def __enter__(self) -> "SGLangServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
