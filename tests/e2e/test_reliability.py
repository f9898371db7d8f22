"""Faults a long run must survive: NaN updates, kill -9 during a step and during a
checkpoint write, Ctrl-C under the --nproc launcher, a second run on a live run
directory, a full disk at a checkpoint and at a log write, 30 steps that must not grow
threads or descriptors, a rank that dies, bad data lines, bad layouts (subprocess runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SUPPORT


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


FAULTY = str(SUPPORT / "faulty_run.py")  # moe-rl with faults injected through test seams


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


def test_a_save_written_during_the_next_steps_rollout_survives_a_crash_in_that_step(base, tmp_path: Path) -> None:
    """Step 2's checkpoint, its writers done while step 3 generates, is committed before step
    3 trains: a crash in step 3's update keeps it (it was committed only at step 3's end, and
    the crash lost it with the whole of step 3's time)."""
    out = run(
        "train",
        *base,
        f"train.run_dir={tmp_path}",
        "train.steps=4",
        "train.save_every=2",
        faults=("--crash-after-rollout-of-step", "3"),
    )
    assert out.returncode != 0 and "injected crash in step 3" in out.stderr, out.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "step_000002" / "meta.json").is_file()


PARTIAL = [
    "rollout.partial.enabled=true",
    "algorithm.old_logprobs=rollout",
    "rollout.max_new_tokens=24",  # long enough for responses to be stopped and carried
    "routing.replay=r3",
    "train.steps=6",
    "train.save_every=3",
    "train.async_save=false",  # step 3's checkpoint committed before step 4 starts
]


def test_kill_9_during_a_partial_rollout_resumes_like_an_uninterrupted_run(base, tmp_path: Path) -> None:
    """Partial rollouts: step 3's checkpoint holds the responses carried into step 4 (tokens,
    versions, log-probs, routing); a run killed (SIGKILL) once step 4's generation has
    continued them resumes there and trains what the uninterrupted run trained, to the same
    final weights."""
    import torch

    straight = tmp_path / "straight"
    out = run("train", *base, *PARTIAL, f"train.run_dir={straight}")
    assert out.returncode == 0, out.stderr[-2000:]
    killed = tmp_path / "killed"
    out = run("train", *base, *PARTIAL, f"train.run_dir={killed}", faults=("--kill-in-partial-rollout-of-step", "4"))
    assert out.returncode == -signal.SIGKILL and sorted(rows(killed)) == [1, 2, 3], out.stderr[-2000:]
    saved = killed / "checkpoints" / "step_000003"
    carry = torch.load(saved / "rollout" / "carry.pt", weights_only=True)
    assert any(s["output_ids"] for g in carry for s in g["samples"]), "nothing was carried into step 4"
    out = run("train", *base, *PARTIAL, f"train.run_dir={killed}")
    assert out.returncode == 0 and "resumed from" in out.stderr, out.stderr[-2000:]
    uninterrupted, resumed = rows(straight), rows(killed)
    assert uninterrupted[4]["rollout/partial/sample_frac"] > 0, "step 4 trained no continued response"
    for step in (4, 5, 6):
        for key in (*COMPARED, "rollout/partial/sample_frac", "rollout/staleness/token_mean"):
            assert resumed[step][key] == uninterrupted[step][key], (step, key)
    final = Path("checkpoints") / "step_000006" / "model"
    assert same_weights(killed / final, straight / final)


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


def test_kill_9_while_the_writers_write_leaves_one_line_and_no_traceback(base, tmp_path: Path) -> None:
    """The writer a killed trainer leaves behind finds no one to report to: one line, a quiet exit."""
    args = cmd(
        "train",
        *base,
        f"train.run_dir={tmp_path}",
        "train.steps=4",
        "train.save_every=2",
        faults=("--writer-delay-s", "3"),
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: any((tmp_path / "checkpoints").glob(".tmp_step_000002.*/writer.sleeping")))
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # the pipe ends once the orphaned writer has exited too
    assert "Traceback" not in err, err[-3000:]
    assert err.count("moe-rl: checkpoint writer ") == 1 and "its trainer is gone; nothing committed" in err, err[-2000:]
    assert not (tmp_path / "checkpoints" / "step_000002").exists()


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


def test_a_rollout_failing_on_the_first_rank_stops_the_rank_waiting_for_its_samples(base, tmp_path: Path) -> None:
    """The waiting rank is stopped by the failure the first rank announced (its line names
    it), not by the launcher or its collective's timeout; the job's code is the first rank's."""
    rank = [FAULTY, "--rollout-error-at-step", "2", "--", "train", *base, f"train.run_dir={tmp_path}", "train.steps=3"]
    launcher = f"import sys; from parallel.launch import spawn_local; sys.exit(spawn_local(2, {rank!r}))"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=200, env=env)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "moe-rl: stopped: injected: every server unreachable in step 2" in out.stderr
    assert "moe-rl: rank 1 stops: rank 0 (" in out.stderr, out.stderr[-3000:]
    assert "failed: RolloutError: injected: every server unreachable in step 2" in out.stderr
    assert "rank 1 exited" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert sorted(rows(tmp_path)) == [1]


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


def test_a_live_run_dir_refuses_a_second_run_compare_and_eval_output_and_kill_9_frees_it(base, tmp_path: Path) -> None:
    """A run holds its run directory (a checkpoint commit held back keeps it alive): a second
    ``moe-rl train`` there is refused in one line naming the holder, as are a ``compare`` over
    it (``--fresh`` deletes nothing) and ``eval --out`` inside it; the first run is unharmed,
    and after ``kill -9`` the directory can be taken again."""
    from moe_rl.checkpoint.run_dir import hold_run_dir, holder_of

    run_dir = tmp_path / "out" / "grpo"
    args = cmd("train", *base, f"train.run_dir={run_dir}", "train.steps=4", "train.save_every=2",
               faults=("--checkpoint-delay-s", "60"))  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(lambda: f"pid {first.pid} " in (holder_of(run_dir) or ""))
        second = run("train", *base, f"train.run_dir={run_dir}", "train.steps=4", "train.resume=true")
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert "is in use by another run (pid" in lines[-1] and str(first.pid) in lines[-1], lines[-1]
        spec = tmp_path / "compare.yaml"
        spec.write_text(f"out_dir: {tmp_path / 'out'}\nbase: {{}}\nruns: {{grpo: {{}}}}\n")
        (tmp_path / "out" / "configs").mkdir()
        (tmp_path / "out" / "configs" / "grpo.yaml").write_text("{}\n")  # as an earlier compare would leave
        compare = run("compare", "--config", str(spec), "--fresh")
        assert compare.returncode == 2 and "nothing was started or deleted" in compare.stderr, compare.stderr[-2000:]
        assert run_dir.is_dir()
        evaluate = run("eval", "--checkpoint", str(run_dir), "--out", str(run_dir / "eval"))
        assert evaluate.returncode == 2 and "inside a live run's directory" in evaluate.stderr, evaluate.stderr
        assert first.poll() is None  # unharmed: still at work
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert holder_of(run_dir) is None
    with hold_run_dir(run_dir):
        assert f"pid {os.getpid()} " in holder_of(run_dir)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB filesystem (room for the run's logs and one checkpoint, not two) mounted for
    the test, and a way to give it room; ``None`` where mounting is not permitted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        yield None
        return
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _stopped_for_space(out: subprocess.CompletedProcess, where: Path) -> None:
    """One line, no traceback, non-zero: the lack of space, naming a file under ``where``."""
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"moe-rl: stopped: no space left on device writing {where}"), last
    assert "the checkpoints before this write are intact" in last


def test_a_full_disk_during_a_checkpoint_stops_in_one_line_and_resumes_exactly_with_room(
    base, uninterrupted, small_disk, tmp_path: Path
) -> None:
    """The disk fills while step 4's checkpoint is written (a real 4 MiB filesystem where the
    test may mount one, else the writers' writes fail with ENOSPC): the run stops in one line
    naming where, step 2's checkpoint stays the intact newest, nothing of step 4 is taken for
    a checkpoint; with room again the same command resumes as the uninterrupted run."""
    from moe_rl.checkpoint.catalog import checkpoint_dirs, select_checkpoint

    run_dir = (small_disk or tmp_path) / "run"
    args = ("train", *base, f"train.run_dir={run_dir}", "train.steps=5", "train.save_every=2", "train.keep_last=3")
    out = run(*args, faults=() if small_disk else ("--full-disk-at-save-step", "4"))
    _stopped_for_space(out, small_disk or run_dir / "checkpoints" / ".tmp_step_000004")
    assert [p.name for _, p in checkpoint_dirs(run_dir)] == ["step_000002"]
    assert select_checkpoint(run_dir)[0].name == "step_000002"
    if small_disk:
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    out = run(*args)
    assert out.returncode == 0 and "step_000002" in out.stderr, out.stderr[-2000:]
    resumed = rows(run_dir)
    for step in (3, 4, 5):
        for key in COMPARED:
            assert resumed[step][key] == uninterrupted[step][key], (step, key)


def test_a_full_disk_at_a_log_write_stops_in_one_line_naming_the_file_and_resumes_exactly(
    base, uninterrupted, tmp_path: Path
) -> None:
    args = ("train", *base, f"train.run_dir={tmp_path}", "train.steps=5", "train.save_every=2", "train.keep_last=3")
    out = run(*args, faults=("--full-disk-at-log-step", "4"))  # (step 2's checkpoint is committed by then)
    _stopped_for_space(out, tmp_path / "metrics.jsonl")
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    out = run(*args)
    assert out.returncode == 0 and "step_000002" in out.stderr, out.stderr[-2000:]
    resumed = rows(tmp_path)
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        for key in COMPARED:
            assert resumed[step][key] == uninterrupted[step][key], (step, key)


def test_thirty_steps_grow_no_threads_descriptors_or_child_processes(base, tmp_path: Path) -> None:
    """``tools/reliability/soak.py``'s short form: 30 steps with a checkpoint every 5 (writers, commits,
    pruning) and the evaluation; threads, open descriptors and children at the end (least
    over a checkpoint's cycle) as after step 10."""
    report = tmp_path / "soak.json"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "tools.reliability.soak", "--steps", "30", "--from-step", "10", "--save-every", "5",
         "--json", str(report), *base],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(report.read_text())
    assert [r["step"] for r in result["readings"]] == list(range(1, 31))
    grew = {k: result["growth"][k] for k in ("threads", "native_threads", "open_fds", "children")}
    assert all(v <= 0 for v in grew.values()), grew
    assert max(r["children"] for r in result["readings"]) >= 1  # the checkpoint writers did run


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
        (
            ["parallel.ep=3"],
            "world size / pp = 1 is not divisible by ep*etp = 3*1 = 3 (the world size is the number of processes: moe-rl train --nproc N",
        ),
        (["parallel.tp=2"], "world size 1 is not divisible by tp*pp = 2*1 = 2"),
    ],
)
def test_bad_layout_fails_fast_with_one_line(base, tmp_path: Path, overrides, message) -> None:
    start = time.monotonic()
    out = run("train", *base, f"train.run_dir={tmp_path}", *overrides)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - start < 60


# ------------------------------------------------------------------ damaged checkpoints


def _flip(file: Path, count: int = 64) -> None:
    data = bytearray(file.read_bytes())
    for i in range(count):
        data[(len(data) // 3 + i * 97) % len(data)] ^= 0xFF
    file.write_bytes(bytes(data))


def _edit_meta(step_dir: Path, **changes) -> None:
    meta = json.loads((step_dir / "meta.json").read_text())
    (step_dir / "meta.json").write_text(json.dumps({**meta, **changes}))


DAMAGE = {  # what is done to a checkpoint, and the reason the warning gives
    "truncated .distcp": (lambda d: os.truncate(d / "dist/__0_1.distcp", 1000), "dist/__0_1.distcp has 1000 bytes"),
    "deleted .distcp": (lambda d: (d / "dist/__0_0.distcp").unlink(), "dist/__0_0.distcp is missing"),
    "64 flipped bytes in a .distcp": (lambda d: _flip(d / "dist/__0_1.distcp"), "dist/__0_1.distcp is damaged"),
    "garbage dist/.metadata": (lambda d: _flip(d / "dist/.metadata", 4000), "dist/.metadata is damaged"),
    "garbage dist/metadata.json": (lambda d: (d / "dist/metadata.json").write_text("{"), "dist/metadata.json has 1"),
    "garbage common.pt": (lambda d: _flip(d / "dist/common.pt", 2000), "dist/common.pt is damaged"),
    "truncated RNG file": (lambda d: os.truncate(d / "rng/rank_00000.pt", 100), "rng/rank_00000.pt has 100 bytes"),
    "meta.json's step edited": (lambda d: _edit_meta(d, step=3), "does not match its seal"),
    "meta.json's fingerprint edited": (lambda d: _edit_meta(d, fingerprint={}), "does not match its seal"),
    "torn meta.json": (lambda d: (d / "meta.json").write_text('{"step": 5'), "meta.json is empty or unreadable"),
}


@pytest.fixture
def run_copy(straight_run, tmp_path: Path) -> Path:
    """A copy of the uninterrupted run's checkpoints (steps 2, 4, 5) to damage."""
    import shutil

    shutil.copytree(straight_run / "checkpoints", tmp_path / "run" / "checkpoints")
    return tmp_path / "run"


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_skipped_with_a_warning_naming_why(run_copy: Path, damage, caplog) -> None:
    from moe_rl.checkpoint.catalog import checkpoint_dirs, select_checkpoint

    newest = run_copy / "checkpoints" / "step_000005"
    do, reason = DAMAGE[damage]
    do(newest)
    with caplog.at_level("WARNING", logger="moe_rl.train"):
        path, meta = select_checkpoint(run_copy)
    assert path.name == "step_000004" and meta["step"] == 4
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"skipping checkpoint {newest}: " in warned[0] and reason in warned[0], warned
    # set aside for a look: not counted by keep_last, not overwritten by the next save of step 5
    assert warned[0].endswith("set aside as step_000005.damaged") and not newest.exists()
    assert (newest.parent / "step_000005.damaged" / "dist").is_dir()
    assert [p.name for _, p in checkpoint_dirs(run_copy)] == ["step_000002", "step_000004"]


def test_a_second_damaged_checkpoint_of_a_step_is_set_aside_beside_the_first(run_copy: Path) -> None:
    from moe_rl.checkpoint.catalog import set_aside

    checkpoints = run_copy / "checkpoints"
    first = set_aside(checkpoints / "step_000005")
    (checkpoints / "step_000005").mkdir()
    second = set_aside(checkpoints / "step_000005")
    assert (first.name, second.name) == ("step_000005.damaged", "step_000005.damaged.2")
    assert (first / "meta.json").is_file() and second.is_dir()


def test_no_intact_checkpoint_is_refused_in_one_line(run_copy: Path, tmp_path: Path) -> None:
    from moe_rl.checkpoint.run_dir import check_run_dir
    from moe_rl.checkpoint.catalog import CheckpointMismatch, select_checkpoint
    from moe_rl.config import ConfigError, load_config

    steps = sorted((run_copy / "checkpoints").iterdir())
    for step in steps:
        _flip(step / "dist" / "__0_0.distcp")
    with pytest.raises(
        CheckpointMismatch, match="no intact checkpoint in .*step_000005: dist/__0_0.distcp is damaged"
    ) as e:
        select_checkpoint(run_copy)
    assert "\n" not in str(e.value)
    for step in steps:  # every meta.json unreadable: refused before anything starts, not a fresh run over them
        (step / "meta.json").write_text("")
    (run_copy / "metrics.jsonl").write_text("kept\n")
    with pytest.raises(ConfigError, match="holds checkpoints .* none of which has a readable meta.json"):
        check_run_dir(load_config(None, [f"train.run_dir={run_copy}"]))
    assert (run_copy / "metrics.jsonl").read_text() == "kept\n" and all(s.is_dir() for s in steps)


def test_no_intact_checkpoint_is_refused_before_any_rollout_server_is_reached(base, run_copy: Path) -> None:
    """The rollout side comes after the resume's checkpoint check: a run on SGLang servers
    (here an address nothing answers at) is refused for its checkpoints, in one line."""
    for step in (run_copy / "checkpoints").iterdir():
        _flip(step / "dist" / "__0_0.distcp")
    out = run(
        "train", *base, f"train.run_dir={run_copy}", "train.steps=6", "train.resume=true",
        "rollout.engine=sglang", "rollout.server.urls=[http://127.0.0.1:9]", "train.resume_anyway=true",
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "no intact checkpoint in" in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]


def test_damaged_model_weights_are_refused_by_eval_and_drift(run_copy: Path) -> None:
    """A checkpoint's model/ (the HF weights eval and drift load) is in the manifest and
    verified before it is read: one flipped chunk is refused in one line naming the file."""
    from moe_rl.checkpoint.catalog import CheckpointMismatch
    from moe_rl.commands.export import model_dir_of

    newest = run_copy / "checkpoints" / "step_000005"
    meta = json.loads((newest / "meta.json").read_text())
    assert "model/config.json" in meta["manifest"]
    assert model_dir_of(str(newest)) == newest / "model"
    (weights,) = sorted((newest / "model").glob("*.safetensors"))
    _flip(weights)
    with pytest.raises(CheckpointMismatch, match=f"model/{weights.name} is damaged"):
        model_dir_of(str(newest))
    out = run("eval", "--checkpoint", str(newest), "--task", "arithmetic")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"model/{weights.name} is damaged" in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]
    prompts = run_copy / "prompts.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7]}\n')
    drift = run(
        "drift", "--a", str(newest), "--b", str(newest), "--prompts", str(prompts), "--out", str(run_copy / "d")
    )
    assert drift.returncode == 2 and f"model/{weights.name} is damaged" in drift.stderr, drift.stderr[-2000:]


def test_a_checkpoint_without_a_manifest_is_accepted_with_a_warning(run_copy: Path, caplog) -> None:
    """Written before moe-rl recorded checksums: presence and the sizes dist/.metadata implies."""
    from moe_rl.checkpoint.catalog import select_checkpoint

    for step in (run_copy / "checkpoints").iterdir():
        meta = json.loads((step / "meta.json").read_text())
        (step / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("manifest", "seal")}))
    os.truncate(run_copy / "checkpoints" / "step_000005" / "dist" / "__0_0.distcp", 1000)
    with caplog.at_level("WARNING", logger="moe_rl.train"):
        path, _ = select_checkpoint(run_copy)
    assert path.name == "step_000004"
    assert "step_000005: dist/__0_0.distcp is truncated (1000 of at least" in caplog.text
    assert f"checkpoint {path} has no manifest" in caplog.text


def test_export_refuses_a_damaged_checkpoint_in_one_line(run_copy: Path, tmp_path: Path) -> None:
    newest = run_copy / "checkpoints" / "step_000005"
    _flip(newest / "dist" / "__0_1.distcp")
    out = run("export", "--checkpoint", str(newest), "--out", str(tmp_path / "hf"))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"moe-rl: error: checkpoint {newest} cannot be trusted: dist/__0_1.distcp is damaged" in out.stderr
    assert not (tmp_path / "hf").exists()


def test_resume_skips_a_damaged_checkpoint_across_transformer_impls(
    base, straight_run, uninterrupted, run_copy: Path
) -> None:
    """A local checkpoint resumed where the layers hold Transformer Engine's extra entries
    (their absence tolerated), that run's checkpoint resumed under the local layers (its
    extra entries unread), past a newer damaged checkpoint: each equal to the uninterrupted run."""
    import shutil

    checkpoints = run_copy / "checkpoints"
    shutil.move(checkpoints / "step_000004", run_copy / "step_000004")
    shutil.move(checkpoints / "step_000005", run_copy / "step_000005")
    args = ("train", *base, f"train.run_dir={run_copy}", "train.save_every=2")
    out = run(*args, "train.steps=4", faults=("--pretend-transformer-engine",))
    assert out.returncode == 0 and "written with transformer_impl=local, read with transformer_engine" in out.stderr, (
        out.stderr[-2000:]
    )
    assert (
        json.loads((checkpoints / "step_000004" / "meta.json").read_text())["transformer_impl"] == "transformer_engine"
    )
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(checkpoints / "step_000004" / "dist")).read_metadata().state_dict_metadata
    assert any("core_attention._extra_state" in key for key in saved)  # what the local layers do not ask for
    shutil.move(run_copy / "step_000005", checkpoints / "step_000005")
    _flip(checkpoints / "step_000005" / "dist" / "__0_0.distcp")
    out = run(*args, "train.steps=5")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"skipping checkpoint {checkpoints / 'step_000005'}: dist/__0_0.distcp is damaged" in out.stderr
    assert "written with transformer_impl=transformer_engine, read with local" in out.stderr
    assert f"resumed from {checkpoints / 'step_000004'}" in out.stderr
    resumed = rows(run_copy)
    for step in (3, 4, 5):
        for key in COMPARED:
            assert resumed[step][key] == uninterrupted[step][key], (step, key)
    final = Path("checkpoints") / "step_000005" / "model"
    assert same_weights(run_copy / final, straight_run / final)


@pytest.mark.unit
def test_the_writers_sum_what_they_wrote_and_the_commit_the_rest(tmp_path: Path) -> None:
    import gc
    from unittest import mock

    from moe_rl.checkpoint import verify
    from moe_rl.checkpoint.verify import SUMS, file_sum, manifest_of, summing_writer

    for folder in ("dist", "rng", SUMS):
        (tmp_path / folder).mkdir()
    (tmp_path / "rng" / "rank_00001.pt").write_bytes(b"rng")
    buckets = [(str(tmp_path / "dist" / f"__1_{i}.distcp"), f"__1_{i}.distcp", ([], [])) for i in range(2)]

    def write(rank, write_buckets, queue) -> None:  # megatron's writer, as the forked writer calls it
        for i, (name, _, _) in enumerate(write_buckets):
            Path(name).write_bytes(bytes([i]) * (1000 + i))

    summing_writer(write, tmp_path, 1)(1, buckets, None)
    report = json.loads((tmp_path / SUMS / "rank_00001.json").read_text())
    assert report == {f"dist/__1_{i}.distcp": list(file_sum(tmp_path / "dist" / f"__1_{i}.distcp")) for i in range(2)}
    (tmp_path / SUMS / "rank_00001.json").write_text(json.dumps({"dist/__1_0.distcp": [1000, 7]}))  # used as reported
    manifest = manifest_of(tmp_path)
    assert manifest["dist/__1_0.distcp"] == [1000, 7] and manifest["rng/rank_00001.pt"] == list(
        file_sum(tmp_path / "rng" / "rank_00001.pt")
    )
    assert manifest["dist/__1_1.distcp"][0] == 1001 and SUMS + "/rank_00001.json" not in manifest
    gc_during_sums = []
    real_sum_files = verify.sum_files
    with mock.patch.object(verify, "sum_files", lambda *a: gc_during_sums.append(gc.isenabled()) or real_sum_files(*a)):
        summing_writer(write, tmp_path, 1)(1, buckets, None)
    assert gc_during_sums == [False] and gc.isenabled()  # off while summing (as megatron's write), back on after
    # an export's files: summed by every rank, its share, right after the export; the commit reads none back
    (tmp_path / "model").mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        (tmp_path / "model" / name).write_bytes(name.encode() * 100)
    for r in (0, 1):
        verify.report_model_sums(tmp_path, r, 2)
    summed_at_commit: list[str] = []
    with mock.patch.object(
        verify, "sum_files", lambda root, names: summed_at_commit.extend(names) or real_sum_files(root, names)
    ):
        manifest = manifest_of(tmp_path)
    assert not [n for n in summed_at_commit if n.startswith("model/")] and summed_at_commit
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        assert manifest[f"model/{name}"] == list(file_sum(tmp_path / "model" / name))
    # a file a writer reported that is not there: an error, never a manifest without it
    (tmp_path / SUMS / "rank_00001.json").write_text(json.dumps({"dist/__1_9.distcp": [5, 1]}))
    with pytest.raises(RuntimeError, match="reported are missing: dist/__1_9.distcp"):
        manifest_of(tmp_path)
