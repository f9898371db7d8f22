"""Device discipline on a CPU-only machine: moe-rl's commands run with "the GPU" a
stand-in accelerator (``tests/support/fake_device.py``) on which a CPU tensor meeting a device
tensor fails, as on CUDA; their numbers equal the plain CPU run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SUPPORT, WARM_START, demo_model_dir, demo_weights_on

SCRIPT = SUPPORT / "device_discipline_checks.py"
TINY = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "train.progress=false",
    "algorithm.micro_batch_size=8",
    "train.steps=2",
    *WARM_START,
]
# the one-process run: R3 with activation recompute, KL to a second model, entropy, two updates a batch
EVERYTHING = [
    "routing.replay=r3",
    "routing.recompute_activations=true",
    "algorithm.kl_coef=0.01",
    "algorithm.reference=device",
    "algorithm.entropy_coef=0.01",
    "algorithm.updates_per_batch=2",
    "algorithm.max_tokens_per_micro_batch=64",
]


def on_device(*args: str, log: Path, timeout_s: int = 400) -> list[dict]:
    """``device_discipline_checks.py args``: each rank's JSON line. Output goes to ``log``,
    not a pipe: torch's shared-memory manager (the tensor sync starts it on CPU) outlives
    the process while a server holds its connection, and would keep a pipe open."""
    with open(log, "w") as out:
        code = subprocess.run(
            [sys.executable, "-W", "ignore", str(SCRIPT), *args], stdout=out, stderr=out, timeout=timeout_s
        ).returncode
    text = log.read_text()
    assert code == 0, text[-6000:]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_the_stand_in_device_refuses_what_cuda_refuses(tmp_path: Path) -> None:
    (facts,) = on_device("selftest", log=tmp_path / "log")
    assert facts == {
        "device": "fakegpu:0",
        "sum": 6.0,
        "host_operand": "refused",
        "numpy": "refused",
        "host_scalar": 6.0,
        "to_host": "cpu",
        "grad_device": "fakegpu:0",
        "tolist": [0, 1],
    }


def test_warm_start_training_and_parity_on_a_device_equal_the_cpu_run(demo_cache: str, tmp_path: Path) -> None:
    """The demo's supervised warm start, a training run with every optional part on, and
    ``moe-rl parity``, on the stand-in device: no host tensor meets a device tensor, and
    the run's metrics equal the same run's on the CPU."""
    run = ["train", *TINY, f"warm_start.cache_dir={demo_cache}", *EVERYTHING]
    (result,) = on_device(
        "prepare",
        "warm_start.steps=2",
        "warm_start.batch_size=8",
        "train.progress=false",
        f"warm_start.cache_dir={tmp_path / 'cache'}",
        "+",
        *run,
        f"train.run_dir={tmp_path / 'device'}",
        "+",
        "parity",
        "--hf-dir",
        demo_model_dir(demo_cache),
        "--batch",
        "2",
        "--seq-len",
        "16",
        log=tmp_path / "log",
    )
    assert result["codes"] == [0, 0, 0] and result["device_tensors"] > 10_000, result
    cpu = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "moe_rl.cli", *run, f"train.run_dir={tmp_path / 'cpu'}"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    device, host = rows(tmp_path / "device"), rows(tmp_path / "cpu")
    for step in (1, 2):
        for key in (
            "train/loss",
            "train/grad_norm",
            "train/kl_ref",
            "train/entropy",
            "reward/total",
            "train/offpolicy/is_weight_mean",
        ):
            assert device[step][key] == pytest.approx(host[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_sglang_path_on_a_device(demo_cache: str, stand_in_sglang, tmp_path: Path) -> None:
    """Training against an SGLang server (tensor sync, R3 from the engine's routing) and
    ``moe-rl drift --engine`` with the trainer's side on the stand-in device."""
    url = demo_weights_on(stand_in_sglang, demo_cache)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 3?"}\n')
    (result,) = on_device(
        "train",
        *TINY,
        f"warm_start.cache_dir={demo_cache}",
        f"train.run_dir={tmp_path / 'run'}",
        "rollout.engine=sglang",
        f"rollout.server.urls=[{url}]",
        "rollout.weight_sync.method=tensor",
        "rollout.weight_sync.bucket_mb=0.05",
        "routing.replay=r3",
        "+",
        "drift",
        "--engine",
        url,
        "--checkpoint",
        str(tmp_path / "run" / "checkpoints" / "step_000002"),
        "--prompts",
        str(prompts),
        "--samples",
        "2",
        "--max-new-tokens",
        "5",
        "--out",
        str(tmp_path / "drift"),
        log=tmp_path / "log",
    )
    assert result["codes"] == [0, 0] and result["device_tensors"] > 1000, result
    assert rows(tmp_path / "run")[2]["routing/train_vs_rollout/changed_frac/mean"] == 0.0  # R3: the engine's routing


@pytest.mark.parametrize(
    "layout",
    [["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1"], ["parallel.pp=2"]],
    ids=["tp2-sp-ep2", "pp2"],
)
def test_two_ranks_on_a_device(demo_cache: str, tmp_path: Path, layout: list[str]) -> None:
    """Model-parallel training (tensor/sequence/expert parallel, or pipeline stages
    exchanging activations) with every rank's tensors on the stand-in device."""
    results = on_device(
        "--ranks",
        "2",
        "train",
        *TINY,
        f"warm_start.cache_dir={demo_cache}",
        f"train.run_dir={tmp_path / 'run'}",
        "routing.replay=r2",
        *layout,
        log=tmp_path / "log",
    )
    assert [r["codes"] for r in results] == [[0], [0]] and min(r["device_tensors"] for r in results) > 1000, results
    assert rows(tmp_path / "run")[2]["train/grad_norm"] > 0
