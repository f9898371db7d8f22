"""The suite's lanes (one folder each), its shared fixtures and its paths.

tests/unit/         one process, no server (the fast lane: run it first)
tests/server/       an SGLang stand-in or a launched (real) server
tests/distributed/  worker processes: gloo ranks running megatron-core, reward workers
tests/e2e/          whole trainer runs and CLI commands
tests/support/      what the tests import or run: the SGLang stand-in, worker and check scripts
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The suite runs on CPU, where the CPU bridge runs megatron's torch.compile'd helpers eagerly
# anyway; with dynamo off, megatron-core's import-time ``torch.compile`` decorators do not pull
# in torch's inductor either: ~1.5 s less start-up for each of the many processes the suite
# starts (they inherit this environment).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# the warm-start settings of every end-to-end test's built-in model (the cache key)
WARM_START = ["warm_start.steps=20", "warm_start.batch_size=16"]
DEFAULT_MODEL = ".default-model"  # in a demo_cache: the name of the model made with the default settings
ROOT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))  # the tests import its modules (fake_device, multi_turn_fns, ...)
# real SGLang for CPU (bash tools/setup.sh --sglang); the tests marked real_sglang need it
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
STAND_IN_SERVER = [sys.executable, "-W", "ignore", str(SUPPORT / "sglang_test_server.py")]


def moe_rl(
    *args: str, timeout: int = 400, cwd: Path | None = None, log: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``moe-rl ARGS`` in a process of its own (warnings off), its output captured, or
    written to ``log`` (a file: a pipe would hang when a child, such as the tensor sync's
    shared-memory manager, outlives the command holding it). ``env``: added variables."""
    command = [sys.executable, "-W", "ignore", "-m", "moe_rl.cli", *args]
    environ = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    if log is None:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=environ)
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=out, timeout=timeout, cwd=cwd, env=environ)
    return subprocess.CompletedProcess(done.args, done.returncode, "", "")


def moe_rl_in_process(*args: str) -> subprocess.CompletedProcess:
    """``moe-rl ARGS`` in this process (for commands that start no process group), as a
    completed process with its exit code and output."""
    import contextlib
    import io

    from moe_rl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["moe-rl", *args], code, out.getvalue(), err.getvalue())


# ------------------------------------------------------------------ lanes
# Every test gets one lane marker by what it costs: its folder's (docs/testing.md), or the one
# it marks itself where its folder's does not fit it (a worker-process test among unit ones).
# real_sglang (a real SGLang server) is marked on its tests and combines with their lane.
LANES = ("unit", "server", "distributed", "e2e")
SERVER_FIXTURES = {"servers", "server", "stand_in_sglang", "real_sglang", "sglang_servers"}


def lane_of(item: pytest.Item) -> str:
    """The lane a test runs in: its own marker, else its folder's."""
    own = [lane for lane in LANES if item.get_closest_marker(lane) is not None]
    if own:
        return own[0]
    folder = item.path.parent.name
    if folder not in LANES:
        raise pytest.UsageError(f"{item.nodeid}: tests live in tests/<lane>/, one of {', '.join(LANES)}")
    if folder == "unit" and SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        raise pytest.UsageError(f"{item.nodeid} starts a server: move it to tests/server/ (or mark its lane)")
    return folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        lane = lane_of(item)
        if item.get_closest_marker(lane) is None:
            item.add_marker(getattr(pytest.mark, lane))


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> str:
    """A warm-start cache holding the built-in model the end-to-end tests train, made once
    per session (``moe-rl prepare``); pass ``warm_start.cache_dir=<it>`` with ``WARM_START``."""
    path = tmp_path_factory.mktemp("demo_cache")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_rl.cli",
            "prepare",
            *WARM_START,
            "train.progress=false",
            f"warm_start.cache_dir={path}",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (model,) = [p.name for p in path.glob("demo-*") if p.is_dir()]
    (path / DEFAULT_MODEL).write_text(model)  # later runs add other families' models beside it
    return str(path)


def run_check_script(name: str, *args: str, timeout_s: int = 300) -> dict:
    """Run ``tests/support/<name>`` (a one-process check that prints JSON lines) in a fresh
    Python; its last JSON line."""
    script = SUPPORT / name
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def demo_model_dir(cache: str) -> str:
    """The built-in model's HF directory inside a ``demo_cache`` (the one the session made
    first, with the default settings)."""
    marker = Path(cache) / DEFAULT_MODEL
    if marker.is_file():
        return str(Path(cache) / marker.read_text())
    (model,) = [p for p in Path(cache).glob("demo-*") if p.is_dir()]
    return str(model)


def start_sglang(model_path: str, log_dir: Path, *, real: bool, extra_args: list[str] = ()):
    """An SGLang server on ``model_path`` started by moe-rl's own server management, with
    routed experts: real SGLang on its CPU backend (``real``), or the protocol stand-in."""
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
    from parallel.launch import free_port

    if real:
        command, device, deterministic = [str(SGLANG_PYTHON), "-m", "sglang.launch_server"], "cpu", False
    else:
        command, device, deterministic = STAND_IN_SERVER, "cuda", True  # "cuda": no CPU flags (the stand-in knows none)
    settings = ServerSettings(
        model_path=model_path,
        port=free_port(),
        return_routed_experts=True,
        deterministic=deterministic,
        device=device,
        launch_command=command,
        extra_args=list(extra_args),
    )
    server = SGLangServer(settings, log_dir)
    try:
        server.wait_healthy(timeout_s=400 if real else 120)
    except BaseException:
        server.stop()
        raise
    return server


def require_real_sglang() -> None:
    if not SGLANG_PYTHON.exists():
        pytest.skip("real SGLang is not installed here (bash tools/setup.sh --sglang makes .venv-sglang)")


@pytest.fixture(scope="session")
def real_sglang(demo_cache, tmp_path_factory):
    """One real SGLang 0.5.23 server (CPU backend) for the whole session, on the built-in
    model; tests that change its weights load them back (``demo_weights_on``)."""
    require_real_sglang()
    server = start_sglang(demo_model_dir(demo_cache), tmp_path_factory.mktemp("real_sglang"), real=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stand_in_sglang(demo_cache, tmp_path_factory):
    """The project's SGLang-protocol stand-in on the built-in model."""
    server = start_sglang(demo_model_dir(demo_cache), tmp_path_factory.mktemp("stand_in_sglang"), real=False)
    yield server
    server.stop()


def demo_weights_on(server, cache: str, version: str = "demo") -> str:
    """Load the built-in model's weights into ``server`` as ``version``; its URL."""
    import httpx

    reply = httpx.post(
        server.url + "/update_weights_from_disk",
        json={"model_path": demo_model_dir(cache), "weight_version": version},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    return server.url
