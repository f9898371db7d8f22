"""The tree is formatted and linted as pyproject.toml's [tool.ruff] says, and its import graph is layered."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
MYPY = shutil.which("mypy", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (bash tools/setup.sh --dev)")
@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args: list[str]) -> None:
    result = subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.skipif(MYPY is None, reason="mypy is not installed (bash tools/setup.sh --dev)")
def test_mypy(tmp_path: Path) -> None:
    """moe_rl/ and parallel/ type-check as pyproject.toml's [tool.mypy] says (a cold cache: ~25 s)."""
    result = subprocess.run(
        [MYPY, "--python-executable", sys.executable, "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_imports_run_downward_without_circles() -> None:
    """tools/dev/import_graph.py: no import runs upward through the layers, no file or folder circle."""
    result = subprocess.run([sys.executable, "-m", "tools.dev.import_graph"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_over_700_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for package in ("moe_rl", "parallel")
        for p in (ROOT / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 700
    }
    assert not long, f"split these modules: {long}"


def test_point_to_point_is_batched() -> None:
    """A single ``dist.send`` / ``recv`` / ``isend`` / ``irecv`` opens a two-rank NCCL
    communicator per pair of ranks (gloo, here, shows nothing): the product sends through
    parallel.collectives.send_tensors / recv_tensors (batched, the group's communicator)."""
    import re

    single = re.compile(r"\bdist\.i?(send|recv)\(")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for package in ("moe_rl", "parallel")
        for p in (ROOT / package).rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if single.search(line)
    ]
    assert not found, found
