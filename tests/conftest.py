"""Fixtures shared by the end-to-end test modules."""

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


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> str:
    """A warm-start cache holding the built-in model the end-to-end tests train, made once
    per session (``moe-rl prepare``); pass ``warm_start.cache_dir=<it>`` with ``WARM_START``."""
    path = tmp_path_factory.mktemp("demo_cache")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "prepare", *WARM_START, "train.progress=false", f"warm_start.cache_dir={path}"],
                         capture_output=True, text=True, timeout=400, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return str(path)


def run_check_script(name: str, *args: str, timeout_s: int = 300) -> dict:
    """Run ``tests/<name>`` (a one-process check that prints JSON lines) in a fresh
    Python; its last JSON line."""
    script = Path(__file__).with_name(name)
    out = subprocess.run([sys.executable, "-W", "ignore", str(script), *args], capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
