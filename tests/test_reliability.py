"""Faults a long run must survive: NaN updates, kill -9 during a step and during a
checkpoint write, Ctrl-C under the --nproc launcher, a rank that dies, bad data lines,
bad layouts (subprocess runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "warm_start.steps=20",
    "warm_start.batch_size=16",
    "train.progress=false",
    "algorithm.micro_batch_size=8",
    "routing.after_update_pass=false",
]


FAULTY = str(Path(__file__).with_name("faulty_run.py"))  # moe-rl with faults injected through test seams


def cmd(*args: str, faults: tuple[str, ...] = ()) -> list[str]:
    if faults:
        return [sys.executable, FAULTY, *faults, "--", *args]
    return [sys.executable, "-m", "moe_rl.cli", *args]


def run(*args: str, faults: tuple[str, ...] = (), timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd(*args, faults=faults), capture_output=True, text=True, timeout=timeout, env=env)


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def base(demo_cache: str) -> list[str]:
    return [*TINY, f"warm_start.cache_dir={demo_cache}"]  # conftest.py: its warm-start settings are TINY's


@pytest.fixture(scope="module")
def straight_run(base, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    out = run("train", *base, f"train.run_dir={run_dir}", "train.steps=5", "train.save_every=2", "train.keep_last=3")
    assert out.returncode == 0, out.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(straight_run) -> dict[int, dict]:
    return rows(straight_run)


COMPARED = ("train/loss", "train/grad_norm", "reward/total", "train/clip_frac")


def test_nan_updates_are_skipped_then_the_run_stops(base, tmp_path: Path) -> None:
    out = run("train", *base, f"train.run_dir={tmp_path}", "train.steps=8", faults=("--nan-steps", "2,4,5,6"))
    assert out.returncode == 3, out.stderr[-2000:]
    assert "3 consecutive steps had NaN/Inf" in out.stderr and "stopped at step 6" in out.stderr
    metrics = rows(tmp_path)
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    assert metrics[2]["train/update_skipped"] == 2 and metrics[3]["train/update_skipped"] == 0
    assert (tmp_path / "checkpoints" / "step_000006" / "meta.json").is_file()


def same_weights(a: Path, b: Path) -> bool:
    """Two HF checkpoint directories hold the same tensors, bit for bit."""
    from moe_rl.models.hf_weights import SafetensorsDir

    wa, wb = SafetensorsDir(a), SafetensorsDir(b)
    return set(wa.keys()) == set(wb.keys()) and all(wa.get(k).equal(wb.get(k)) for k in wa.keys())


def test_kill_9_during_a_step_resumes_like_an_uninterrupted_run(
    base, straight_run, uninterrupted, tmp_path: Path
) -> None:
    args = cmd("train", *base, f"train.run_dir={tmp_path}", "train.steps=5", "train.save_every=2")
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    metrics, saved = tmp_path / "metrics.jsonl", tmp_path / "checkpoints" / "step_000002" / "meta.json"
    # step 2's checkpoint is written in the background and committed after a later step
    wait_for(lambda: saved.is_file() and len(metrics.read_text().splitlines()) >= 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = run("train", *base, f"train.run_dir={tmp_path}", "train.steps=5", "train.save_every=2")
    assert out.returncode == 0 and "resumed from" in out.stderr, out.stderr[-2000:]
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5], "steps re-run after the checkpoint are logged once"
    resumed = rows(tmp_path)
    for step in (3, 4, 5):
        for key in COMPARED:
            assert resumed[step][key] == uninterrupted[step][key], (step, key)
    final = Path("checkpoints") / "step_000005" / "model"
    assert same_weights(tmp_path / final, straight_run / final)


def test_kill_9_during_a_checkpoint_write_keeps_the_last_good_one(
    base, straight_run, uninterrupted, tmp_path: Path
) -> None:
    import shutil

    # a run that stopped after step 2 (its checkpoint is the uninterrupted run's)
    shutil.copytree(straight_run / "checkpoints" / "step_000002", tmp_path / "checkpoints" / "step_000002")
    args = cmd(
        "train",
        *base,
        f"train.run_dir={tmp_path}",
        "train.steps=4",
        "train.save_every=2",
        faults=("--checkpoint-delay-s", "60"),
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    # written by every rank's writer, not yet committed
    wait_for(
        lambda: any(
            (tmp / "dist" / ".metadata").is_file() for tmp in (tmp_path / "checkpoints").glob(".tmp_step_000004.*")
        )
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "checkpoints" / "step_000004").exists()
    out = run("train", *base, f"train.run_dir={tmp_path}", "train.steps=4", "train.save_every=2")
    assert out.returncode == 0 and "step_000002" in out.stderr, out.stderr[-2000:]
    resumed = rows(tmp_path)
    for step in (3, 4):
        for key in COMPARED:
            assert resumed[step][key] == uninterrupted[step][key], (step, key)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def test_ctrl_c_under_the_launcher_saves_one_checkpoint_and_exits(base, tmp_path: Path) -> None:
    """Ctrl-C reaches the launcher; each rank must see it once (a second one means "stop now")."""
    args = cmd("train", "--nproc", "2", *base, f"train.run_dir={tmp_path}", "train.steps=50")
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    metrics = tmp_path / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.count("stopped on request after step") == 2  # both ranks finished the step
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].startswith("step_") and int(saved[0][5:]) < 50
    meta = json.loads((tmp_path / "checkpoints" / saved[0] / "meta.json").read_text())
    assert meta["world_size"] == 2


def test_export_reads_any_checkpoint_under_any_layout(straight_run, tmp_path: Path) -> None:
    """A checkpoint's sharded weights, read under another layout, make the same HF
    directory as the HF weights it was saved with; one without HF weights says how."""
    from moe_rl.commands.export import model_dir_of

    final = straight_run / "checkpoints" / "step_000005"
    out = run("export", "--checkpoint", str(final), "--out", str(tmp_path / "hf"), "--nproc", "2", "--ep", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert same_weights(tmp_path / "hf", final / "model")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    middle = straight_run / "checkpoints" / "step_000004"
    assert not (middle / "model").exists()  # HF weights only at the last step (train.export_every=0)
    with pytest.raises(FileNotFoundError, match="no Hugging Face weights.*moe-rl export --checkpoint"):
        model_dir_of(str(middle))


DEAD_RANK = """
import os, signal, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone
time.sleep(600)
"""


def test_a_dead_rank_stops_the_job_and_is_named() -> None:
    start = time.monotonic()
    launcher = f"import sys; from parallel.launch import spawn_local; sys.exit(spawn_local(2, ['-c', {DEAD_RANK!r}]))"
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60
    assert out.returncode != 0 and "[moe-rl] rank 1 was killed by SIGKILL: stopping the job" in out.stderr, out.stderr[
        -2000:
    ]


def test_bad_data_lines_are_skipped_with_file_and_line(base, tmp_path: Path, caplog) -> None:
    from moe_rl.data.tasks import DatasetTask

    data = tmp_path / "data.jsonl"
    data.write_bytes(
        b'{"prompt": "1+2=", "answer": "3"}\n'
        b'{"prompt": "2+2=", "answer": \n'
        b'{"prompt": "", "answer": "0"}\n'
        b'{"prompt": "3+\xff=", "answer": "3"}\n'
        b'{"prompt": "4+4=", "answer": "8"}\n'
    )
    with caplog.at_level("WARNING"):
        task = DatasetTask(str(data))
    for line in (2, 3, 4):
        assert f"{data}:{line}" in caplog.text
    assert "not UTF-8" in caplog.text and "not valid JSON" in caplog.text
    assert [p.prompt for p in task.items] == ["1+2=", "4+4="] and len(task.skipped) == 3  # logged as data/skipped_lines
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    from moe_rl.config import ConfigError, load_config
    from moe_rl.trainer.trainer import Trainer

    with pytest.raises(
        ConfigError, match="data.task: .* holds no usable problems"
    ):  # before any process group or model
        Trainer(load_config(None, [*base, f"train.run_dir={tmp_path / 'e'}", f"data.task={empty}"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.ep=3"], "world size / pp = 1 is not divisible by ep*etp = 3*1 = 3"),
        (["parallel.tp=2"], "world size 1 is not divisible by tp*pp = 2*1 = 2"),
    ],
)
def test_bad_layout_fails_fast_with_one_line(base, tmp_path: Path, overrides, message) -> None:
    start = time.monotonic()
    out = run("train", *base, f"train.run_dir={tmp_path}", *overrides)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - start < 60
