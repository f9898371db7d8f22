"""The async-rollout thread (moe_rl/experience/background.py): results and failures reach
the step that takes them, and a run that stops does not wait for a collection in flight."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from moe_rl.experience.background import BackgroundRollout


def test_a_collections_result_or_failure_reaches_the_step_that_takes_it() -> None:
    def collect(step: int):
        if step == 2:
            raise ConnectionError("server gone")
        return f"experience {step}", {}

    background = BackgroundRollout(SimpleNamespace(collect=collect))
    background.start(1)
    assert background.take(2) is None and background.take(1) == ("experience 1", {})
    background.start(2)
    with pytest.raises(ConnectionError, match="server gone"):
        background.wait()
    background.close()


def test_a_stopping_run_exits_without_waiting_for_the_collection_in_flight() -> None:
    """A crash while the next step's rollout runs: the process ends at once (an executor's
    thread was joined at exit: the whole collection, minutes on a real server)."""
    script = (
        "import time\n"
        "from types import SimpleNamespace\n"
        "from moe_rl.experience.background import BackgroundRollout\n"
        "background = BackgroundRollout(SimpleNamespace(collect=lambda step: time.sleep(60)))\n"
        "background.start(1)\n"
        "time.sleep(0.2)\n"
        "background.close()\n"
        "raise SystemExit(3)\n"
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert out.returncode == 3, out.stderr[-2000:]
    assert time.monotonic() - start < 30  # the import is most of it; the collection would hold it 60 s
