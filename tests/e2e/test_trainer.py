"""The RL trainer end to end (subprocesses): resume equals an uninterrupted run, a
2-process DeepSpeed launch with EP=2, and `moe-rl compare` writing its report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SUPPORT, moe_rl

ROOT = Path(__file__).parents[2]
TINY = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "warm_start.steps=20",
    "warm_start.batch_size=16",
    "train.progress=false",
    "algorithm.micro_batch_size=8",
]


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def cache(demo_cache: str) -> str:
    return demo_cache  # conftest.py: its warm-start settings are TINY's


CHAT = "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a:{% endif %}"


def chat_model_and_data(cache: str, root: Path) -> list[str]:
    """The built-in model with a chat template (in the tokenizer's characters) and Parquet
    train / held-out sets with their own field names: the overrides that use them."""
    import random
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from moe_rl.config import load_config
    from moe_rl.models.demo_model import demo_model_dir

    model = root / "chat-model"
    shutil.copytree(demo_model_dir(load_config(None, [*TINY, f"warm_start.cache_dir={cache}"]).demo_model()), model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(model)
    rng = random.Random(0)
    for name, count in (("train", 24), ("heldout", 4)):
        pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]
        rows = [{"question": f"{a}+{b}=", "meta": {"solution": str(a + b)}} for a, b in pairs]
        pq.write_table(pa.Table.from_pylist(rows), root / f"{name}.parquet")
    return [
        f"model.hf_dir={model}",
        f"data.task={root / 'train.parquet'}",
        "data.prompt_key=question",
        "data.answer_key=meta.solution",
        "data.chat_template=true",
        "data.system_prompt=Add.",
        f"data.eval_task={root / 'heldout.parquet'}",
        "data.eval_samples=2",
        "train.eval_every=2",
    ]


def test_resume_equals_uninterrupted(cache, tmp_path: Path) -> None:
    """Parquet data with its own field names, a chat template, evaluation on held-out
    problems, a warmup + cosine learning rate, DAPO dynamic sampling and R2: a run resumed
    from its step-2 checkpoint continues exactly as the uninterrupted run."""
    common = [
        *TINY,
        *chat_model_and_data(cache, tmp_path),
        "routing.replay=r2",
        "optim.lr=1e-3",
        "optim.min_lr=1e-4",
        "optim.lr_schedule=cosine",
        "optim.warmup_steps=1",
        "rollout.dynamic_sampling.enabled=true",
    ]
    straight = moe_rl("train", *common, f"train.run_dir={tmp_path / 'a'}", "train.steps=4", "train.save_every=2")
    assert straight.returncode == 0, straight.stderr[-3000:]
    # a run that stopped after step 2: the straight run's checkpoint, and its log (which
    # also holds steps 3-4: a resumed run must drop those rows and log each step once)
    import shutil

    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000002", tmp_path / "b" / "checkpoints" / "step_000002")
    shutil.copy(tmp_path / "a" / "metrics.jsonl", tmp_path / "b" / "metrics.jsonl")
    resumed = moe_rl("train", *common, f"train.run_dir={tmp_path / 'b'}", "train.steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
        2,
        3,
        4,
    ]
    for step in (3, 4):
        for key in (
            "train/loss",
            "train/grad_norm",
            "reward/total",
            "train/clip_frac",
            "routing/expert_change_frac/mean",
            "train/lr",
            "data/kept_group_frac",
        ):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    for step in range(1, 5):  # warmup 1 step, then cosine towards min_lr (reached one step after the last)
        assert a[step]["train/lr"] == pytest.approx(
            1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * (step - 1) / 4)), rel=1e-6
        )
    # evaluated before training, every 2 steps and at the end; identically after the resume
    assert [s for s in sorted(a) if "eval/pass@1" in a[s]] == [0, 2, 4] and a[4]["eval/prompts"] == 4
    assert {k: v for k, v in a[4].items() if k.startswith("eval/")} == {
        k: v for k, v in b[4].items() if k.startswith("eval/")
    }
    ckpts = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"]  # keep_last=2, no temporary left
    _eval_and_export_match_the_trainer(tmp_path / "b" / "checkpoints" / "step_000004", b[4], tmp_path)
    from moe_rl.config import ConfigError, load_config
    from moe_rl.checkpoint.run_dir import check_run_dir

    changed = load_config(None, [*common, f"train.run_dir={tmp_path / 'b'}", "train.steps=6", "algorithm.loss=gspo"])
    with pytest.raises(ConfigError, match="holds a run with another config \\(algorithm.loss: 'grpo' -> 'gspo'\\)"):
        check_run_dir(changed)  # what `moe-rl train` checks first: its checkpoints say which config wrote them


def _eval_and_export_match_the_trainer(checkpoint: Path, logged: dict, tmp_path: Path) -> None:
    """`moe-rl eval` of the checkpoint (its run's config: chat template, held-out set)
    reproduces the trainer's last evaluation; `moe-rl export` output loads in transformers,
    whose greedy generations equal the local engine's."""
    out = moe_rl("eval", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "eval"))
    assert out.returncode == 0, out.stderr[-3000:]
    scalars = json.loads((tmp_path / "eval" / "eval.json").read_text())["scalars"]
    assert scalars == {k: v for k, v in logged.items() if k.startswith("eval/")}
    out = moe_rl("export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_rl.rollout.local import LocalEngine
    from moe_rl.rollout.types import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("1+2=", "7+5=", "9+9=")
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    greedy = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, stop_token_ids=(tokenizer.eos_token_id,))
    engine_out = [g[0].output_ids for g in LocalEngine(str(tmp_path / "hf")).generate(ids, 1, greedy, seed=0)]
    for prompt, got in zip(ids, engine_out):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=6,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        assert got == ref, (tokenizer.decode(prompt), got, ref)


def test_two_process_deepspeed_launch_with_ep2(cache, tmp_path: Path) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    cmd = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--num_gpus",
        "2",
        "--master_port",
        "29641",
        "--module",
        "moe_rl.train",
        *TINY,
        f"warm_start.cache_dir={cache}",
        "parallel.ep=2",
        "train.steps=2",
        f"train.run_dir={tmp_path / 'ds'}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = rows(tmp_path / "ds")
    assert sorted(metrics) == [1, 2] and metrics[2]["train/grad_norm"] > 0
    meta = json.loads((tmp_path / "ds" / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["world_size"] == 2


def test_compare_writes_report_from_logs(cache, tmp_path: Path) -> None:
    out = moe_rl(
        "compare",
        "--config",
        str(ROOT / "configs/compare/demo.yaml"),
        "--only",
        "grpo,grpo_r2",
        *TINY,
        f"warm_start.cache_dir={cache}",
        "train.steps=2",
        "data.eval_max_prompts=4",
        "data.eval_samples=2",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "runs/compare/report.md").read_text()
    assert "| grpo |" in report and "| grpo_r2 |" in report and "## The papers' claims" in report
    evaluated = [
        line
        for line in report.split("## Held-out evaluation")[1].split("## Cost")[0].splitlines()
        if line.startswith("| grpo")
    ]
    assert len(evaluated) == 2 and all(
        line.endswith("| 2 |") for line in evaluated
    )  # evaluated at steps 0 and 2 (the end)
    assert (tmp_path / "runs/compare/plots/reward.png").is_file()
    from moe_rl.report import read_scalars

    r2 = read_scalars(tmp_path / "runs/compare/grpo_r2")
    assert set(r2["routing/replayed/changed_frac/mean"].values()) == {0.0}
    # R2 leaves no token whose routing changed since the old policy; without replay the second update has some
    assert (
        set(r2["train/tokens/routing_changed"].values()) == {0.0} and min(r2["train/tokens/routing_same"].values()) > 0
    )
    assert max(read_scalars(tmp_path / "runs/compare/grpo")["train/tokens/routing_changed"].values()) > 0
    assert len(r2["reward/total"]) == 2


def test_kl_entropy_and_rollout_old_logprobs(cache, tmp_path: Path) -> None:
    # 4 prompts x 5 samples = 20 in micro-batches of at most 8: 3 micro-batches of 7 rows, one row empty
    out = moe_rl(
        "train",
        *TINY,
        f"warm_start.cache_dir={cache}",
        f"train.run_dir={tmp_path / 'k'}",
        "train.steps=2",
        "rollout.group_size=5",
        "algorithm.kl_coef=0.1",
        "algorithm.entropy_coef=0.01",
        "algorithm.old_logprobs=rollout",
        "algorithm.loss=gmpo",
        "algorithm.advantage=gdpo",
        "routing.metrics=false",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = rows(tmp_path / "k")
    assert metrics[1]["train/kl_ref"] >= 0.0 and metrics[2]["train/kl_ref"] > 0.0  # the policy moved off the reference
    assert metrics[2]["train/entropy"] > 0 and metrics[2]["train/logp_mismatch_mean"] < 1e-4
    assert not any(k.startswith("routing/") for k in metrics[2])


SGLANG_RUNS = {"none": ("tp2", "parallel.tp=2"), "r2": ("pp2", "parallel.pp=2"), "r3": ("ep2", "parallel.ep=2")}


@pytest.fixture(scope="module")
def sglang_servers(cache, tmp_path_factory):
    """Two SGLang-protocol test servers shared by the SGLang runs, as long-lived servers
    are by successive (restarted, resumed) trainers: each run joins them in a
    weight-update group of its own and syncs its weights first. They start, as SGLang
    does, at weight_version "default"."""
    import httpx

    servers = start_test_servers(cache, tmp_path_factory.mktemp("servers"), 2)
    try:
        for server in servers:
            server.wait_healthy(timeout_s=120)
            assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "default"
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize("replay", list(SGLANG_RUNS))
def test_train_against_an_sglang_protocol_server(cache, sglang_servers, tmp_path: Path, replay: str) -> None:
    """The trainer's SGLang path end to end on 2 processes (tp2 | pp2 | ep2) with two
    servers: a distributed sync in several buckets before the first rollout and after
    every step, each server's weights afterwards bit-equal to the trainer's."""
    import httpx

    from moe_rl.rollout.local import LocalEngine
    from sglang_test_server import weights_digest

    layout, layout_setting = SGLANG_RUNS[replay]
    urls = ",".join(s.url for s in sglang_servers)
    before = [httpx.get(server.url + "/_test/stats").json() for server in sglang_servers]
    out = moe_rl(
        "train",
        "--nproc",
        "2",
        *TINY,
        f"warm_start.cache_dir={cache}",
        f"train.run_dir={tmp_path / 'run'}",
        "train.steps=2",
        layout_setting,
        "rollout.engine=sglang",
        f"rollout.server.urls=[{urls}]",
        "rollout.weight_sync.bucket_mb=0.05",
        f"routing.replay={replay}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    final = LocalEngine(str(tmp_path / "run" / "checkpoints" / "step_000002" / "model"))
    for server, earlier in zip(sglang_servers, before):
        assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "2"
        assert httpx.get(server.url + "/_test/weights_digest").json()["digest"] == weights_digest(final.model), layout
        stats = httpx.get(server.url + "/_test/stats").json()
        updates = stats["weight_updates"] - earlier["weight_updates"]
        requests = stats["weight_update_requests"] - earlier["weight_update_requests"]
        assert updates == 3 and requests >= 3 * 2, stats  # 3 syncs, >1 bucket each
        sent = stats["update_requests"][len(earlier["update_requests"]) :]
        # each bucket one flat broadcast; pp2: each stage's first rank sends its own (a group each)
        assert all(r["flattened"] for r in sent) and len({r["group"] for r in sent}) == (2 if layout == "pp2" else 1), (
            sent
        )
        assert stats["weight_groups"] == [], stats  # the trainer's weight-update group was torn down at its end
    if replay == "none":  # the servers now serve the last checkpoint: in fp32 they route as the trainer does
        _engine_drift_is_zero(sglang_servers[0].url, tmp_path / "run" / "checkpoints" / "step_000002", tmp_path)
    metrics = rows(tmp_path / "run")
    assert sorted(metrics) == [1, 2] and metrics[2]["train/grad_norm"] > 0
    for step in (1, 2):
        # the servers generated with the trainer's current weights: their log-probs are the trainer's
        assert metrics[step]["train/logp_mismatch_max"] < 1e-4, metrics[step]["train/logp_mismatch_max"]
    # train-inference routing drift is measured in any replay mode (R3: computed with the server's routing)
    changed = metrics[2]["routing/train_vs_rollout/changed_frac/mean"]
    assert changed == 0.0 if replay == "r3" else changed < 0.05
    if replay != "none":  # the update passes dispatched to the replayed experts
        assert all(metrics[step]["routing/replayed/changed_frac/mean"] == 0.0 for step in (1, 2))
    split = metrics[2]["routing/train_vs_rollout/logp_mismatch/mean"]
    assert split == pytest.approx(metrics[2]["train/logp_mismatch_mean"], rel=1e-6)


def start_test_servers(cache: str, tmp_path: Path, count: int, **settings) -> list:
    """``count`` SGLang-protocol test servers of the built-in model (not yet healthy)."""
    from moe_rl.config import load_config
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
    from moe_rl.models.demo_model import demo_model_dir
    from parallel.launch import free_port

    model_dir = str(
        demo_model_dir(load_config(None, [*TINY, f"warm_start.cache_dir={cache}"]).demo_model())
    )  # made by `cache`
    from conftest import STAND_IN_SERVER

    every = [
        ServerSettings(
            model_path=model_dir,
            port=free_port(),
            return_routed_experts=True,
            deterministic=True,
            launch_command=STAND_IN_SERVER,
            **settings,
        )
        for _ in range(count)
    ]
    return [SGLangServer(s, tmp_path / "logs") for s in every]


def test_colocated_training_takes_turns_with_the_server(cache, tmp_path: Path) -> None:
    """rollout.colocate with the tensor sync: the server releases its memory for every
    update and takes it back around a sync by reference; the trainer's state goes to host
    memory and back each step (its log-probs still equal the server's: nothing lost)."""
    import httpx

    from moe_rl.rollout.local import LocalEngine
    from sglang_test_server import weights_digest

    (server,) = start_test_servers(cache, tmp_path, 1, memory_saver=True)
    try:
        server.wait_healthy(timeout_s=120)
        args = [
            *TINY,
            f"warm_start.cache_dir={cache}",
            f"train.run_dir={tmp_path / 'run'}",
            "train.steps=2",
            "train.save_every=1",
            "rollout.engine=sglang",
            f"rollout.server.urls=[{server.url}]",
            "rollout.weight_sync.method=tensor",
            "rollout.colocate=true",
            "rollout.weight_sync.bucket_mb=0.05",
        ]
        # output to a file, not a pipe: on CPU, torch's shared-memory manager (which the
        # tensor sync starts) outlives the trainer while the server holds its connection
        with open(tmp_path / "train.log", "w") as log:
            code = subprocess.run(
                [sys.executable, "-W", "ignore", "-m", "moe_rl.cli", "train", *args],
                stdout=log,
                stderr=log,
                timeout=400,
            ).returncode
        assert code == 0, (tmp_path / "train.log").read_text()[-3000:]
        stats = httpx.get(server.url + "/_test/stats").json()
        final = LocalEngine(str(tmp_path / "run" / "checkpoints" / "step_000002" / "model"))
        assert httpx.get(server.url + "/_test/weights_digest").json()["digest"] == weights_digest(final.model)
    finally:
        server.stop()
    turn = [
        ["release", ["cuda_graph", "kv_cache", "weights"]],
        ["resume", ["weights"]],
        ["resume", ["cuda_graph", "kv_cache"]],
    ]
    # at start (the server gives its memory back before the trainer builds its state, then
    # takes it back around the first sync), then per step the update and each checkpoint
    # (its optimizer state is brought back for it)
    assert stats["memory_events"] == turn * 5, stats["memory_events"]
    assert stats["releases_after_updates"][0] == 0  # released before any weights came
    assert stats["weight_updates"] == 1 + 4 and stats["weight_update_requests"] >= 2 * 5  # several buckets each
    metrics = rows(tmp_path / "run")
    for step in (1, 2):
        assert metrics[step]["train/logp_mismatch_max"] < 1e-4 and metrics[step]["train/grad_norm"] > 0


def _engine_drift_is_zero(url: str, checkpoint: Path, tmp_path: Path) -> None:
    """`moe-rl drift --engine` on 2 processes (EP=2) against an fp32 server with the same weights."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 3?"}\n{"prompt": "What is 7 + 1?"}\n')
    out = moe_rl(
        "drift",
        "--engine",
        url,
        "--checkpoint",
        str(checkpoint),
        "--prompts",
        str(prompts),
        "--samples",
        "3",
        "--max-new-tokens",
        "8",
        "--out",
        str(tmp_path / "drift"),
        "--nproc",
        "2",
        "--ep",
        "2",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "drift" / "drift.json").read_text())
    assert report["engine_weight_version"] == "2" and report["samples"] == 6 and report["layout"]["ep"] == 2
    assert report["metrics"]["changed_frac"]["layers"] == [0.0] * len(report["layers"])
    assert (
        report["metrics"]["any_layer_changed_frac"]["mean"] == 0.0
        and report["logp_mismatch"]["logp_mismatch_max"] < 1e-4
    )


FAMILY_RUNS = [
    f"{family}-{mode}:1,1,1,1:{mode}+{family}:3"
    for family in ("qwen2", "olmoe", "glm", "dsv3")
    for mode in ("r2", "r3")
]
# the simulated mismatch (rollout.simulate_mismatch, 0.2 of tokens per layer): seen by the
# trainer without replay, replayed exactly by R3 (softmax and sigmoid + bias routers)
SIM_RUNS = [
    "one-sim:1,1,1,1:none+sim:2",
    "one-r3sim:1,1,1,1:r3+sim:2",
    "dsv3-r3sim:1,1,1,1:r3+dsv3+sim:2",
    "glm-r3sim:1,1,1,1:r3+glm+sim:2",
    "one-r3simlogit:1,1,1,1:r3+simlogit:2",
]
LAYOUT_RUNS = {  # name:tp,pp,ep,etp:variant[:steps[:save=other]] (tests/support/trainer_layouts_worker.py), in this order
    # (+dyn: micro-batches packed under a budget of 24 tokens, smaller than the one-process reference's derived default)
    2: [
        "tp2-r2:2,1,1,2:r2",
        "tp2etp1-r3:2,1,1,1:r3",
        "ep2-r3+dyn:1,1,2,1:r3+dyn",
        "pp2-kl+dyn:1,2,1,1:kl+dyn",
        "ep2-mt:1,1,2,1:mt",
        "pp2-r3l3:1,2,1,1:r3+l3",  # 3 layers on 2 pipeline stages: 2 + 1
        # drift metrics on half the tokens through recompute (r3) on pp2 (test_sampled_drift_metrics_...)
        "pp2-r3+dyn+half:1,2,1,1:r3+dyn+half",
        # checkpoints resumed under other layouts (pp2 -> one process; ep2 x dp2, distributed optimizer -> tp2 x dp2)
        "pp2-save:1,2,1,1:none:2:save=one-from-pp2",
        "ep2-save:1,1,2,1:none:2:save=tp2dp2-from-ep2",
    ],
    1: [
        "one-none4:1,1,1,1:none:4",
        "one-from-pp2:1,1,1,1:none:4",
        "one-r2:1,1,1,1:r2",
        "one-r3:1,1,1,1:r3",
        "one-kl:1,1,1,1:kl",
        "one-kl2:1,1,1,1:kl:2",
        "one-kldev2:1,1,1,1:kldev:2",
        "one-async3:1,1,1,1:r3+async:3",
        "one-mt:1,1,1,1:mt",
        "one-r3l3:1,1,1,1:r3+l3",
        *FAMILY_RUNS,
        *SIM_RUNS,
    ],
    4: [
        "tp2dp2-from-ep2:2,1,1,2:none:4",
        "pp2ep2-r2:1,2,2,1:r2",
        "tp2ep2etp1-r3:2,1,2,1:r3",
        "tp2ep2etp2-kl:2,1,2,2:kl",
    ],
}


@pytest.fixture(scope="module")
def layout_runs(cache, tmp_path_factory) -> Path:
    from parallel.launch import spawn_local

    out = tmp_path_factory.mktemp("layouts")
    worker = str(SUPPORT / "trainer_layouts_worker.py")
    for nproc, runs in LAYOUT_RUNS.items():
        code = spawn_local(nproc, ["-W", "ignore", worker, str(out), cache, *runs], timeout_s=600)
        assert code == 0, f"{nproc}-process trainer worker failed with exit code {code}"
    return out


@pytest.mark.parametrize("run", ["one-r2", "one-r3", "tp2-r2", "ep2-r3+dyn"])
def test_a_steps_routing_state_is_freed_before_the_next_rollout(layout_runs: Path, run: str) -> None:
    """Replay indices and the drift monitor's routing, masks and statistics (device memory a
    colocated rollout wants) are dropped once the step's metrics are reduced."""
    held = json.loads((layout_runs / f"{run}.routing_held.json").read_text())
    assert held.get("replay_indices") == 0 and held.get("monitor") == 0, held


def test_async_rollouts_train_on_samples_one_version_behind(layout_runs: Path) -> None:
    """Step 3 trained on samples generated (with the engine's routing replayed, R3) while
    step 2 trained, from the weights before step 2's update."""
    last = json.loads((layout_runs / "one-async3.json").read_text())
    assert last["rollout/policy_lag"] == 1.0 and last["train/grad_norm"] > 0 and last["train/update_skipped"] == 0
    # the ratio's denominator is the behaviour policy: at the first update it is the
    # trainer's log-prob of the rollout weights' samples, which differ from the trained weights
    assert last["train/logp_mismatch_max"] > 1e-3


def test_collectives_wait_as_configured_and_nccl_runs_without_cumem(layout_runs: Path) -> None:
    """train.collective_timeout_min reaches the process group (the other ranks wait in a
    collective through each rollout); NCCL_CUMEM_ENABLE=0 is set as SGLang sets it, since
    the weight-update group spans both on one node."""
    for run in ("one-r2", "tp2-r2", "pp2ep2-r2"):
        facts = json.loads((layout_runs / f"{run}.process_group.json").read_text())
        assert facts == {"timeout_s": 45 * 60, "NCCL_CUMEM_ENABLE": "0"}, (run, facts)


def test_reference_swapped_in_from_host_equals_a_second_model(layout_runs: Path) -> None:
    # step 2: the policy has moved off the reference (step 1's update), so the KL is not 0
    host, device = (json.loads((layout_runs / f"one-{v}.json").read_text()) for v in ("kl2", "kldev2"))
    assert host["train/kl_ref"] == device["train/kl_ref"] > 0 and host["train/loss"] == device["train/loss"]
    assert host["train/grad_norm"] == device["train/grad_norm"]  # and the policy's own weights came back exactly
    assert (
        host["reward/total"] == device["reward/total"]
    )  # the rollout engine got the trained weights, not the reference


@pytest.mark.parametrize(
    "run",
    [
        r.split(":")[0]
        for n in (2, 4)
        for r in LAYOUT_RUNS[n]
        if ":save=" not in r and "-from-" not in r and "+half" not in r  # sampled metrics: their own test
    ],
)
def test_first_step_on_every_layout_equals_one_process(layout_runs: Path, run: str) -> None:
    """Same model, data and seed: rank 0's rollouts are identical, and the first update's
    loss, grad norm and KL agree with the one-process run to float error."""
    variant = run.rsplit("-", 1)[1].split("+")[0]
    ref = json.loads((layout_runs / f"one-{variant}.json").read_text())
    got = json.loads((layout_runs / f"{run}.json").read_text())
    assert got["reward/total"] == ref["reward/total"] and got["advantage/std"] == ref["advantage/std"]
    assert got["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-5)
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)
    assert got["train/entropy"] == pytest.approx(ref["train/entropy"], rel=1e-5)
    assert got["train/logp_mismatch_mean"] == pytest.approx(ref["train/logp_mismatch_mean"], abs=1e-6)
    if variant == "kl":
        assert got["train/kl_ref"] == pytest.approx(ref["train/kl_ref"], abs=1e-6)
    row, ref_row = rows(layout_runs / run)[1], rows(layout_runs / f"one-{variant}")[1]
    if variant == "r2":  # the update pass used the recorded experts (the logged row has the routing tags)
        assert row["routing/replayed/changed_frac/mean"] == 0.0
    if variant == "mt":  # environment tokens went to each rank with their samples' loss masks
        assert (
            row["rollout/multi_turn/environment_tokens_mean"]
            == ref_row["rollout/multi_turn/environment_tokens_mean"]
            > 0
        )
        assert row["routing/train_vs_rollout/environment_tokens/changed_frac/mean"] == 0.0
    # train-inference drift, and the rollout mismatch split by it, gathered over the layout's token slices
    assert row["routing/train_vs_rollout/changed_frac/mean"] == ref_row["routing/train_vs_rollout/changed_frac/mean"]
    assert row["routing/train_vs_rollout/logp_mismatch/mean"] == pytest.approx(
        got["train/logp_mismatch_mean"], rel=1e-6, abs=1e-12
    )
    # ... each response token counted once, whichever ranks hold it (pipeline stages, TP ranks)
    counted = row["routing/train_vs_rollout/routing_same_tokens/mean"] + row.get(
        "routing/train_vs_rollout/routing_changed_tokens/mean", 0
    )
    assert (
        counted
        == ref_row["routing/train_vs_rollout/routing_same_tokens/mean"]
        + ref_row.get("routing/train_vs_rollout/routing_changed_tokens/mean", 0)
        > 0
    )


def test_sampled_drift_metrics_through_recompute_on_pp2(layout_runs: Path) -> None:
    """routing.metrics_sample_frac=0.5 with activation recompute (r3), 2 pipeline stages and
    token-budget micro-batches of unequal sizes: the first stage's backward recomputes
    micro-batch i after micro-batch i+1's forward (whose sampled tokens reached past
    micro-batch i's: IndexError before the probe skipped recompute). The step trains as
    the one-process run does, and the drift metrics estimate all tokens from half."""
    got = json.loads((layout_runs / "pp2-r3+dyn+half.json").read_text())
    ref = json.loads((layout_runs / "one-r3.json").read_text())
    assert got["reward/total"] == ref["reward/total"]
    assert got["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-5)
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)
    row, ref_row = rows(layout_runs / "pp2-r3+dyn+half")[1], rows(layout_runs / "one-r3")[1]
    assert row["routing/replayed/changed_frac/mean"] == row["routing/train_vs_rollout/changed_frac/mean"] == 0.0
    tokens = "routing/train_vs_rollout/routing_same_tokens/mean"
    assert row[tokens] == pytest.approx(ref_row[tokens], rel=0.1)


@pytest.mark.parametrize("run", ["one-from-pp2", "tp2dp2-from-ep2"])
def test_a_checkpoint_resumes_under_another_layout(layout_runs: Path, run: str) -> None:
    """Checkpoints written after step 2 under pp2 (one-process optimizer) and ep2 x dp2
    (distributed optimizer) resume in one process and under tp2 x dp2: weights and
    optimizer state reshard, and steps 3 and 4 (after an update from the loaded Adam state)
    equal an uninterrupted one-process run's."""
    ref, resumed = rows(layout_runs / "one-none4"), rows(layout_runs / run)
    assert sorted(resumed) == [3, 4]  # resumed after step 2
    for step in (3, 4):
        got, want = resumed[step], ref[step]
        assert got["reward/total"] == want["reward/total"] and got["advantage/std"] == want["advantage/std"], step
        assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-5), step
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-4), step


@pytest.mark.parametrize("run", [r.split(":")[0] for r in SIM_RUNS])
def test_simulated_mismatch_is_seen_by_the_trainer_and_replayed_exactly_by_r3(layout_runs: Path, run: str) -> None:
    """The engine's perturbed routing (its choice only): without replay the trainer finds about
    the target share of its router choices differing from the engine's; R3 replays the engine's
    choices, perturbed ones included, so none differ and the trainer's log-probs are the engine's
    (Qwen3-MoE, DeepSeek-V3, GLM-4.5); with the engine's logits perturbed as well, what R3 leaves
    is that part, at its target KL."""
    steps = rows(layout_runs / run)
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert row["rollout/simulated_mismatch/target_flip_frac"] == 0.2
        assert 0.1 <= row["rollout/simulated_mismatch/flip_frac/mean"] <= 0.3
        changed = row["routing/train_vs_rollout/changed_frac/mean"]
        assert changed == 0.0 if "r3" in run else 0.05 <= changed <= 0.4, changed
        mismatch = row["train/logp_mismatch_max"]
        if "simlogit" in run:
            assert 1e-3 <= row["train/offpolicy/kl_k3"] <= 4e-3 and mismatch > 1e-2
        else:
            assert mismatch < 1e-4 if "r3" in run else mismatch > 1e-2, mismatch


@pytest.mark.parametrize("run", [r.split(":")[0] for r in FAMILY_RUNS])
def test_three_steps_of_each_family_with_replay(layout_runs: Path, run: str) -> None:
    """Qwen2-MoE, OLMoE, GLM-4.5 and DeepSeek-V3 built-in models train 3 steps under R2
    and R3: the update passes dispatch to the replayed experts, R3's old pass to the
    engine's, and GLM's / DeepSeek's expert biases move by the configured rate at every
    update."""
    family, mode = run.split("-")
    steps = rows(layout_runs / run)
    assert sorted(steps) == [1, 2, 3]
    for row in steps.values():
        assert math.isfinite(row["train/loss"]) and row["train/update_skipped"] == 0.0
        assert row["routing/replayed/changed_frac/mean"] == 0.0
        if mode == "r3":
            assert row["routing/train_vs_rollout/changed_frac/mean"] == 0.0
            assert row["train/logp_mismatch_mean"] < 1e-4
        if family in (
            "glm",
            "dsv3",
        ):  # one update per step: every expert's bias moves by exactly the rate (or 0 at a tie)
            assert 0.005 < row["routing/expert_bias_delta/mean"] <= 0.01 + 1e-6
        else:
            assert "routing/expert_bias_delta/mean" not in row
        if family == "glm":  # with the after-update pass: the routing the bias change alone made (here most of it)
            assert 0 < row["routing/expert_bias_effect/changed_frac/mean"] <= 1
