"""``moe-rl parity`` and ``moe-rl export`` end to end (subprocesses, real HTTP-free CLI)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.models.export_dir import MARKER
from moe_rl.models.hf_weights import SafetensorsDir, write_config_files
from moe_rl.models.tiny import save_tiny_checkpoint

from conftest import moe_rl


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones included) and its bytes (``None``: a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-rl: error: --out: "), out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "qwen3": save_tiny_checkpoint(root / "qwen3", "qwen3_moe", seed=2, norm_topk_prob=False),
    }


def test_parity_with_transformers_and_its_verdict(checkpoints) -> None:
    # the command end to end (every family and layout: tests/distributed/test_megatron_backend.py); at
    # tolerance 0 the (non-zero) float differences must fail it with exit code 1
    out = moe_rl("parity", "--hf-dir", checkpoints["qwen3"], "--tolerance", "0")
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("parity"))
    diffs = [float(x) for x in re.findall(r"(\d\.\d+e[-+]\d+)", line)]
    assert len(diffs) == 2 and 0 < max(diffs) <= 1e-4 and line.endswith("FAILED")  # log-prob and entropy


def test_bad_layout_is_one_clear_line(checkpoints) -> None:
    out = moe_rl("parity", "--hf-dir", checkpoints["qwen3"], "--nproc", "2", "--ep", "3")
    assert out.returncode == 2
    assert "moe-rl: error:" in out.stderr and "Traceback" not in out.stderr
    missing = moe_rl("parity", "--hf-dir", "/nonexistent/dir")
    assert (
        missing.returncode == 2
        and "'/nonexistent/dir' does not exist (a Hugging Face model directory" in missing.stderr
    )


def test_export_reproduces_the_input_bitwise(checkpoints, tmp_path: Path) -> None:
    # the command end to end (exports of every family under every layout: tests/distributed/test_megatron_backend.py)
    src = checkpoints["qwen3"]
    out = moe_rl("export", "--checkpoint", src, "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stdout + out.stderr
    a, b = SafetensorsDir(src), SafetensorsDir(tmp_path / "hf")
    assert a.keys() == b.keys()
    for key in a.keys():
        assert torch.equal(a.get(key), b.get(key)), key
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert model.config.model_type == "qwen3_moe"
    assert not list(tmp_path.glob(".hf.tmp-*")), "temporary export directory left behind"
    mask = os.umask(0)
    os.umask(mask)  # written as any tool writes: readable by a server running as another user (umask 022)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~mask
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()} == {0o666 & ~mask}
    marker = json.loads((tmp_path / "hf" / MARKER).read_text())
    assert marker["written_by"].startswith("moe-rl ") and marker["dtype"] == "float32"

    # an export is replaced by the next one (a stale file in it goes with it)
    (tmp_path / "hf" / "stale.txt").write_text("from the first export")
    again = moe_rl("export", "--checkpoint", src, "--out", str(tmp_path / "hf"), "--dtype", "bfloat16")
    assert again.returncode == 0, again.stdout + again.stderr
    assert not (tmp_path / "hf" / "stale.txt").exists()
    assert SafetensorsDir(tmp_path / "hf").dtype() == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or moved-aside directory left


@pytest.mark.unit  # one process, no CLI
def test_config_and_tokenizer_files_honour_the_umask(tmp_path: Path) -> None:
    """A checkpoint's hf/ files are written with the umask's permissions, whatever the
    source's (a world-readable tokenizer in a shared cache stays private under umask 077)."""
    from transformers import AutoConfig

    source = Path(save_tiny_checkpoint(tmp_path / "base", "qwen3_moe", seed=1))
    (source / "tokenizer.json").write_text("{}")
    (source / "tokenizer.json").chmod(0o644)
    mask = os.umask(0o077)
    try:
        write_config_files(AutoConfig.from_pretrained(source), tmp_path / "hf", source)
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "tokenizer.json" in modes and "config.json" in modes
    assert set(modes.values()) == {0o600}, modes


def test_export_never_replaces_a_directory_it_did_not_make(checkpoints, tmp_path: Path) -> None:
    # a copy of a base model (its own index.json) with a README and a folder of its own
    base = tmp_path / "base"
    shutil.copytree(checkpoints["qwen3"], base)
    (base / "README.md").write_text("the model card")
    (base / "extra").mkdir()
    (base / "extra" / "notes.txt").write_text("keep me")
    index = {"metadata": {}, "weight_map": dict.fromkeys(SafetensorsDir(base).keys(), "model.safetensors")}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))  # as a sharded base model has
    before = tree(tmp_path)
    line = one_error_line(moe_rl("export", "--checkpoint", checkpoints["qwen3"], "--out", str(base)))
    assert str(base) in line and f"was not written by moe-rl export (no {MARKER} in it): nothing was touched" in line
    assert tree(tmp_path) == before


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create anything in (root ignores permissions: sysfs)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        return locked
    if os.access("/sys", os.W_OK) and Path("/sys/kernel").is_dir():
        return Path("/sys")
    pytest.skip("no directory this root process cannot write")


def test_export_to_a_bad_out_is_one_line_and_leaves_nothing(checkpoints, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("x")
    locked = _unwritable_dir(tmp_path)
    cases = {
        "": "an empty path names no directory",
        "a_file": "exists and is not a directory",
        "a_file/sub": "a_file is not a directory",
        str(locked / "new" / "out"): f"{locked} is not writable",
        "/": "is a file system root",
    }
    before = tree(tmp_path)
    for out, why in cases.items():
        line = one_error_line(moe_rl("export", "--checkpoint", checkpoints["qwen3"], "--out", out, cwd=tmp_path))
        assert why in line, (out, line)
        assert tree(tmp_path) == before, out
    if locked.is_relative_to(tmp_path):
        locked.chmod(0o755)


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_parity_under_a_launcher(checkpoints, launcher) -> None:
    import os

    bin_dir = Path(sys.executable).parent
    if launcher == "deepspeed":
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", "29631", "--module", "moe_rl.cli"]
    else:
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--master_port", "29632", "-m", "moe_rl.cli"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        cmd + ["parity", "--hf-dir", checkpoints["qwen3"], "--pp", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "parity tp=1 pp=2" in out.stdout and "OK" in out.stdout
