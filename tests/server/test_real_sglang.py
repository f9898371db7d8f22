"""The trainer's SGLang paths against real SGLang 0.5.23 on its CPU backend (one server for
the session, started by moe-rl's own server management; ``bash tools/setup.sh --sglang``
installs it, and these tests are skipped with that hint where it is absent).

The server computes in bf16 (the built-in model's fp32 config, SGLang's ``dtype=auto``);
the trainer and transformers in fp32, so log-probs and routing differ a little; what the
tests print (``-s``) is recorded in docs/sglang.md."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import SGLANG_PYTHON, SUPPORT, WARM_START, demo_model_dir, demo_weights_on, moe_rl, start_sglang
from moe_rl.rollout.local import LocalEngine
from moe_rl.rollout.sglang.engine import SGLangEngine
from moe_rl.rollout.types import RolloutError, SamplingParams
from moe_rl.routing.drift import changed_frac
from moe_rl.routing.encoding import decode_routed_experts
from moe_rl.routing.hf_routing import transformers_routing

pytestmark = pytest.mark.real_sglang
QUESTIONS = ["3+4=", "7+5=", "9+9=", "1+2=", "6+0=", "8+3="]
SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "train.progress=false",
    "algorithm.micro_batch_size=8",
    *WARM_START,
]


def moe_rl_logged(*args: str, log: Path, timeout: int = 400, tests_importable: bool = False) -> int:
    """``moe-rl ARGS``'s exit code, its output in ``log``; ``tests_importable``: ``tests/support/`` on
    its ``PYTHONPATH`` (for the test generate functions)."""
    env = {"PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    return moe_rl(*args, log=log, timeout=timeout, env=env if tests_importable else None).returncode


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def prompt_ids(cache: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir(cache))
    return [tokenizer(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def greedy_tokens(url: str, prompts: list[list[int]], max_new_tokens: int = 6) -> list[list[int]]:
    """The server's greedy outputs (temperature 0: SGLang's top-1)."""
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    return [r["output_ids"] for r in httpx.post(url + "/generate", json=body, timeout=120).json()]


def test_samples_logprobs_and_routing_agree_with_the_trainer_side(real_sglang, demo_cache):
    """The client's samples from the real server: log-probs within bf16 noise of an fp32
    forward on the same weights, routed experts decoded as [prompt+output-1, layers, k]
    and mostly equal to the fp32 router's; greedy tokens equal the local engine's."""
    url = demo_weights_on(real_sglang, demo_cache)
    prompts = prompt_ids(demo_cache)
    engine = SGLangEngine([url], num_layers=2, top_k=2, num_experts=8)
    groups = engine.generate(
        prompts, 4, SamplingParams(max_new_tokens=6, temperature=1.0), seed=3, return_routed_experts=True
    )
    local = LocalEngine(demo_model_dir(demo_cache))
    gaps, changed, tokens = [], [], 0
    for sample in (s for group in groups for s in group):
        assert sample.weight_version == "demo" and len(sample.output_logprobs) == len(sample.output_ids)
        ids = torch.tensor([sample.prompt_ids + sample.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(local.model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float(), dim=-1)
        trainer_logp = logp.gather(1, torch.tensor(sample.output_ids)[:, None]).squeeze(1)
        gaps.append((trainer_logp - torch.tensor(sample.output_logprobs)).abs())
        experts, _ = transformers_routing(local.model, ids[:, :-1])
        assert sample.routed_experts.shape == experts[0].shape == (ids.shape[1] - 1, 2, 2)
        changed.append(changed_frac(sample.routed_experts.long(), experts[0]) * experts.shape[1])
        tokens += experts.shape[1]
    gap = torch.cat(gaps)
    drift = (torch.stack(changed).sum(0) / tokens).tolist()
    print(
        f"\n[real sglang] log-prob |server - fp32| mean {gap.mean():.2e} max {gap.max():.2e} over {gap.numel()} tokens; "
        f"routing changed (server bf16 vs fp32) per layer {[round(x, 4) for x in drift]} over {tokens} positions"
    )
    assert gap.mean() < 2e-2 and gap.max() < 0.25
    assert max(drift) < 0.1  # a few near-ties flip in bf16, most tokens route alike
    greedy = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, stop_token_ids=(1,))
    assert greedy_tokens(url, prompts) == [s.output_ids for [s] in local.generate(prompts, 1, greedy, seed=0)]


def test_routed_experts_of_prefix_cached_tokens_equal_an_uncached_prefill(real_sglang, demo_cache):
    """A second turn (turn 1's prompt and output, then inserted tokens) hits the prefix
    cache; SGLang 0.5.23 still returns the routing of every position, equal to what a
    prefill with nothing cached routes (multi-turn R3 can use it as returned)."""
    url = demo_weights_on(real_sglang, demo_cache)

    def routed(ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor, int]:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
            "return_routed_experts": True,
        }
        meta = (reply := httpx.post(url + "/generate", json=body, timeout=120).json())["meta_info"]
        return reply["output_ids"], decode_routed_experts(meta["routed_experts"], 2, 2), meta["cached_tokens"]

    httpx.post(url + "/flush_cache", timeout=30)
    first = prompt_ids(demo_cache)[0] * 4
    output, turn_one, _ = routed(first, 6)
    second = first + output + [21, 22, 23]  # the policy's tokens, then the environment's
    _, turn_two, cached = routed(second, 6)
    httpx.post(url + "/flush_cache", timeout=30)
    _, uncached, _ = routed(second, 1)
    assert cached >= len(first)  # the prefix cache was hit
    assert torch.equal(turn_two[: len(second) - 1], uncached[: len(second) - 1])
    assert torch.equal(turn_two[: len(turn_one)], turn_one)


def test_close_aborts_only_its_own_requests(real_sglang, demo_cache):
    """An interrupted client's ``close()`` aborts the requests it left running; another
    client's request on the same server finishes."""
    import threading

    url = demo_weights_on(real_sglang, demo_cache)
    # as long as the demo model's 256-token context allows: a fast spell decoded 200 tokens
    # within the wait below, and the request finished before its abort came
    long = {"max_new_tokens": 250, "temperature": 1.0, "ignore_eos": True}
    other: dict = {}
    bystander = threading.Thread(
        target=lambda: other.update(
            httpx.post(
                url + "/generate",
                json={"input_ids": [3, 4, 5], "sampling_params": long, "rid": "someone-else"},
                timeout=120,
            ).json()
        )
    )
    engine = SGLangEngine([url], num_layers=2, top_k=2)
    mine: dict = {}
    requester = threading.Thread(
        target=lambda: mine.update(
            httpx.post(
                url + "/generate",
                json={"input_ids": [3, 4, 5], "sampling_params": long, "rid": "moe-rl-mine"},
                timeout=120,
            ).json()
        )
    )
    bystander.start(), requester.start()
    time.sleep(0.2)  # both decoding (the requests reach the server within milliseconds)
    engine._unfinished = {"moe-rl-mine"}  # what an interrupted generate() leaves
    engine.close()
    requester.join(60), bystander.join(60)
    assert mine["meta_info"]["finish_reason"]["type"] == "abort", mine["meta_info"]["finish_reason"]
    assert other["meta_info"]["finish_reason"]["type"] == "length" and len(other["output_ids"]) == 250


@pytest.mark.parametrize(("replay", "sync"), [("r3", "distributed"), ("none", "disk"), ("r2", "tensor")])
def test_train_against_real_sglang(real_sglang, demo_cache, tmp_path, replay, sync):
    """`moe-rl train rollout.engine=sglang` for each replay mode and weight sync: the
    server serves each step's weights (its weight_version follows), R3 replays its routing
    exactly, and after the run its greedy tokens equal the local engine's on the last
    checkpoint's exported weights."""
    url = demo_weights_on(real_sglang, demo_cache)
    run = tmp_path / "run"
    code = moe_rl_logged(
        "train",
        *SMALL,
        f"warm_start.cache_dir={demo_cache}",
        f"train.run_dir={run}",
        "train.steps=2",
        "rollout.engine=sglang",
        f"rollout.server.urls=[{url}]",
        f"rollout.weight_sync.method={sync}",
        f"routing.replay={replay}",
        "rollout.weight_sync.bucket_mb=0.05",
        log=tmp_path / "train.log",
    )
    assert code == 0, (tmp_path / "train.log").read_text()[-3000:]
    if sync != "disk":  # SGLang 0.5.23 takes each bucket as one flat tensor
        assert re.search(
            r"weights 2 (sent|handed) to 1 server\(s\) in \d+ flattened bucket", (tmp_path / "train.log").read_text()
        )
    metrics = rows(run)
    assert sorted(metrics) == [1, 2] and metrics[2]["train/grad_norm"] > 0
    assert httpx.get(url + "/model_info", timeout=30).json()["weight_version"] == "2"
    for step in (1, 2):
        assert metrics[step]["train/logp_mismatch_mean"] < 2e-2  # bf16 server vs fp32 trainer
    drift = [metrics[s]["routing/train_vs_rollout/changed_frac/mean"] for s in (1, 2)]
    print(
        f"\n[real sglang] {replay}/{sync}: log-prob mismatch mean {[metrics[s]['train/logp_mismatch_mean'] for s in (1, 2)]}, "
        f"train-vs-rollout routing changed {drift}"
    )
    if replay == "r3":
        assert drift == [0.0, 0.0]  # the trainer ran on the server's routing
    else:
        assert max(drift) < 0.1
    final = str(run / "checkpoints" / "step_000002" / "model")
    greedy = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, stop_token_ids=(1,))
    prompts = prompt_ids(demo_cache)
    assert greedy_tokens(url, prompts) == [
        s.output_ids for [s] in LocalEngine(final).generate(prompts, 1, greedy, seed=0)
    ]
    if sync == "distributed":  # and equal to a server started afresh on those weights
        fresh = start_sglang(final, tmp_path / "fresh", real=True)
        try:
            assert greedy_tokens(fresh.url, prompts, 12) == greedy_tokens(url, prompts, 12)
            _a_killed_server_is_a_rollout_error(fresh)
        finally:
            fresh.stop()


def test_multi_turn_r3_training_against_real_sglang(real_sglang, demo_cache, tmp_path):
    """Two policy turns around inserted tokens (tests/support/multi_turn_fns.py): each later turn
    asks for the routing of its new positions only (the prefix comes from the cache);
    joined, they are every trained token's routing: R3's train-vs-rollout change is 0 on
    the policy's and the environment's tokens."""
    url = demo_weights_on(real_sglang, demo_cache)
    run = tmp_path / "run"
    code = moe_rl_logged(
        "train",
        *SMALL,
        f"warm_start.cache_dir={demo_cache}",
        f"train.run_dir={run}",
        "train.steps=2",
        "rollout.engine=sglang",
        f"rollout.server.urls=[{url}]",
        "rollout.weight_sync.method=disk",
        "routing.replay=r3",
        "rollout.multi_turn.generate_fn=multi_turn_fns:two_turns",
        log=tmp_path / "train.log",
        tests_importable=True,
    )
    assert code == 0, (tmp_path / "train.log").read_text()[-3000:]
    metrics = rows(run)
    for step in (1, 2):
        row = metrics[step]
        assert row["rollout/multi_turn/turns_mean"] > 1 and row["rollout/multi_turn/environment_tokens_mean"] > 0
        assert row["routing/train_vs_rollout/changed_frac/mean"] == 0.0
        assert row["routing/train_vs_rollout/environment_tokens/changed_frac/mean"] == 0.0
        assert row["train/logp_mismatch_mean"] < 2e-2  # bf16 server vs fp32 trainer
    print(
        f"\n[real sglang] multi-turn r3: turns {[metrics[s]['rollout/multi_turn/turns_mean'] for s in (1, 2)]}, "
        f"log-prob mismatch mean {[metrics[s]['train/logp_mismatch_mean'] for s in (1, 2)]}"
    )


def _a_killed_server_is_a_rollout_error(server) -> None:
    """A server killed (SIGKILL, all its processes) under a client: generate() ends in a
    RolloutError naming it after its retries, not a hang or an httpx traceback."""
    engine = SGLangEngine([server.url], num_layers=2, top_k=2, max_retries=1, backoff_s=0.1, timeout_s=60)
    _ = engine.weight_version  # read while it lives
    os.killpg(server.process.pid, signal.SIGKILL)
    with pytest.raises(RolloutError, match=server.url.replace(".", r"\.")):
        engine.generate([[3, 4, 5]] * 2, 2, SamplingParams(max_new_tokens=6, temperature=1.0), seed=0)


def test_drift_and_eval_against_real_sglang(real_sglang, demo_cache, tmp_path):
    """`moe-rl drift --engine` and `moe-rl eval --engine` measure the real server."""
    url = demo_weights_on(real_sglang, demo_cache)
    model = demo_model_dir(demo_cache)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS[:3]))
    code = moe_rl_logged(
        "drift",
        "--engine",
        url,
        "--checkpoint",
        model,
        "--prompts",
        str(prompts),
        "--samples",
        "2",
        "--max-new-tokens",
        "6",
        "--out",
        str(tmp_path / "drift"),
        log=tmp_path / "drift.log",
    )
    assert code == 0, (tmp_path / "drift.log").read_text()[-3000:]
    report = json.loads((tmp_path / "drift" / "drift.json").read_text())
    assert report["engine_weight_version"] == "demo" and report["samples"] == 6
    assert 0 <= report["metrics"]["changed_frac"]["mean"] < 0.1 and report["logp_mismatch"]["logp_mismatch_max"] < 0.25
    code = moe_rl_logged(
        "eval",
        "--checkpoint",
        model,
        "--engine",
        url,
        "--out",
        str(tmp_path / "eval"),
        *SMALL,
        "data.eval_task=arithmetic",
        "data.eval_max_prompts=8",
        log=tmp_path / "eval.log",
    )
    assert code == 0, (tmp_path / "eval.log").read_text()[-3000:]
    scalars = json.loads((tmp_path / "eval" / "eval.json").read_text())["scalars"]
    assert 0.0 <= scalars["eval/pass@1"] <= 1.0, scalars


def test_compare_against_real_sglang(real_sglang, demo_cache, tmp_path):
    """A short `moe-rl compare` of GRPO with and without R3 on the real server (the runs
    share it, so they take turns) writes its report."""
    url = demo_weights_on(real_sglang, demo_cache)
    config = Path(__file__).parents[2] / "configs" / "compare" / "demo.yaml"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_rl.cli",
            "compare",
            "--config",
            str(config),
            "--only",
            "grpo,grpo_r3",
            *SMALL,
            f"warm_start.cache_dir={demo_cache}",
            "train.steps=2",
            "train.eval_every=0",
            "data.eval_max_prompts=4",
            "rollout.engine=sglang",
            f"rollout.server.urls=[{url}]",
            "rollout.precision=fp32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "run one at a time" in out.stdout
    report = (tmp_path / "runs" / "compare" / "report.md").read_text()
    assert "grpo_r3" in report and sorted(rows(tmp_path / "runs" / "compare" / "grpo_r3")) == [1, 2]


def test_a_launched_server_dies_with_its_killed_trainer(demo_cache, tmp_path):
    """`rollout.server.launch=true` with SGLang's own Python: the trainer starts a real
    server (CPU flags) and trains on it; killed with SIGKILL, it takes the server (all of
    its processes) with it."""
    if not SGLANG_PYTHON.exists():
        pytest.skip("real SGLang is not installed here (bash tools/setup.sh --sglang makes .venv-sglang)")
    from parallel.launch import free_port

    def launch(run: Path, steps: int) -> subprocess.Popen:
        args = [
            *SMALL,
            f"warm_start.cache_dir={demo_cache}",
            f"train.run_dir={run}",
            f"train.steps={steps}",
            "rollout.engine=sglang",
            "rollout.server.launch=true",
            f"rollout.server.python={SGLANG_PYTHON}",
            f"rollout.server.port={free_port()}",
            "routing.replay=r3",
        ]
        log = open(run.parent / f"{run.name}.log", "w")
        return subprocess.Popen(
            [sys.executable, "-W", "ignore", "-m", "moe_rl.cli", "train", *args], stdout=log, stderr=log
        )

    def server_pid(run: Path, timeout_s: float = 400) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid_files = list((run / "logs").glob("sglang-*.pid")) if (run / "logs").exists() else []
            if pid_files and (run / "metrics.jsonl").exists():  # started and trained a step
                return json.loads(pid_files[0].read_text())["pid"]
            time.sleep(0.5)
        raise AssertionError(f"no step after {timeout_s}s: {(run.parent / f'{run.name}.log').read_text()[-3000:]}")

    def group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False

    run = tmp_path / "run"
    trainer = launch(run, steps=50)
    try:
        pid = server_pid(run)
        assert "--device cpu" in " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        deadline = time.monotonic() + 60
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not group_alive(pid), "the launched SGLang server outlived its trainer"
    finally:
        trainer.kill()
        trainer.wait(30)
