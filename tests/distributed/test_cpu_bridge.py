"""parallel.cpu_bridge in a fresh process; its multi-process behaviour (uneven gloo
collectives under EP x ETP, RNG, streams) is covered by test_megatron_backend."""

from __future__ import annotations

import subprocess
import sys

from conftest import SUPPORT


def test_bridge_checks_in_a_fresh_process() -> None:
    script = SUPPORT / "bridge_checks.py"
    out = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bridge checks passed" in out.stdout


def test_bridge_refuses_a_cuda_machine(monkeypatch) -> None:
    import torch

    from parallel import cpu_bridge

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_bridge, "_INSTALLED", False)
    try:
        cpu_bridge.install()
    except RuntimeError as e:
        assert "machines without CUDA" in str(e)
    else:
        raise AssertionError("install() must refuse when CUDA is available")
