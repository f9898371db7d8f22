"""Rollouts: SGLangEngine over real HTTP against the SGLang-protocol test server
(started through SGLangServer, the code that starts real servers), and LocalEngine
against the trainer."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import STAND_IN_SERVER, SUPPORT
from moe_rl.models.hf_weights import SafetensorsDir
from moe_rl.models.tiny import save_tiny_checkpoint
from moe_rl.models.weight_buckets import Bucket, WeightEntry, plan_buckets
from moe_rl.rollout.local import LocalEngine
from moe_rl.rollout.sglang.engine import SGLangEngine
from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer, stop_stale_server
from moe_rl.rollout.sglang.turns import HttpTurns
from moe_rl.rollout.sglang.weight_updates import weight_group_offsets
from moe_rl.rollout.types import RolloutError, SamplingParams, StaleWeightsError
from moe_rl.rollout.weight_sync.distributed import DistributedSync
from parallel.launch import free_port
from parallel.weight_update_group import join_weight_update_group
from sglang_test_server import weights_digest

SERVER = STAND_IN_SERVER
PROMPTS = [[3, 17, 22, 5], [9, 1, 40, 33, 2, 8]]
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rollout")
    return {
        "v0": save_tiny_checkpoint(root / "v0", "qwen3_moe", seed=11),
        "v1": save_tiny_checkpoint(root / "v1", "qwen3_moe", seed=12),
    }


def start_server(model_path: str, log_dir: Path) -> SGLangServer:
    settings = ServerSettings(
        model_path=model_path, port=free_port(), return_routed_experts=True, deterministic=True, launch_command=SERVER
    )
    server = SGLangServer(settings, log_dir)
    server.wait_healthy(timeout_s=120)
    return server


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    started = [start_server(ckpts["v0"], log_dir), start_server(ckpts["v0"], log_dir)]
    yield started
    for s in started:
        s.stop()


def engine_for(servers, **kwargs) -> SGLangEngine:
    return SGLangEngine([s.url for s in servers], num_layers=2, top_k=2, **kwargs)


def control(server, path: str, body: dict | None = None) -> dict:
    return httpx.post(server.url + path, json=body or {}, timeout=10).json()


def test_generate_logprobs_routing_and_distinct_seeds(servers, ckpts) -> None:
    engine = engine_for(servers)
    groups = engine.generate(PROMPTS, 3, PARAMS, seed=5, return_routed_experts=True)
    assert [len(g) for g in groups] == [3, 3]
    local = LocalEngine(ckpts["v0"]).generate(PROMPTS, 3, PARAMS, seed=5, return_routed_experts=True)
    seeds = [s.seed for g in groups for s in g]
    assert len(set(seeds)) == len(seeds), "every sample must get its own sampling_seed"
    for group, local_group in zip(groups, local):
        outputs = {tuple(s.output_ids) for s in group}
        assert len(outputs) > 1, "a group's samples must not repeat one sampling stream"
        for s, ref in zip(group, local_group):
            assert s.seed == ref.seed and s.output_ids == ref.output_ids  # the seed reached this sample
            assert s.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-6)
            assert s.finish_reason in ("stop", "length") and s.weight_version == "default"  # learned from the server
            assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.output_ids) - 1, 2, 2)
            assert torch.equal(s.routed_experts, ref.routed_experts)


def test_server_rules_and_client_errors(servers) -> None:
    url = servers[0].url
    bad = httpx.post(
        url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "best_of": 3}}
    )
    assert bad.status_code == 400 and "best_of" in bad.text
    outside = httpx.post(
        url + "/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": [], "group_name": "g"}
    )
    assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]
    engine = engine_for(servers[:1], max_retries=3, backoff_s=0.01)
    with pytest.raises(RolloutError, match="refused the request \\(HTTP 400\\)"):
        import asyncio

        async def post():
            async with httpx.AsyncClient() as client:
                return await engine._post_with_retries(
                    client, "/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}
                )

        asyncio.run(post())
    assert engine.retries == 0, "4xx must not be retried"


def test_retries_on_5xx_and_malformed_replies(servers) -> None:
    control(servers[0], "/_test/faults", {"fail_status": 503, "fail_count": 2, "malformed_count": 1})
    engine = engine_for(servers[:1], backoff_s=0.01)
    groups = engine.generate(PROMPTS[:1], 1, PARAMS, seed=1)
    assert groups[0][0].output_ids and engine.retries == 3


def test_update_weights_from_disk_and_stale_version(servers, ckpts) -> None:
    engine = engine_for(servers)
    engine.update_weights_from_disk(ckpts["v1"], "1")
    try:
        ((sample,),) = engine.generate(PROMPTS[:1], 1, PARAMS, seed=3)
        ((ref,),) = LocalEngine(ckpts["v1"]).generate(PROMPTS[:1], 1, PARAMS, seed=3)
        assert sample.weight_version == "1" and sample.output_ids == ref.output_ids
        # a server that changed version behind the trainer's back is detected
        control(servers[1], "/update_weights_from_disk", {"model_path": ckpts["v1"], "weight_version": "7"})
        with pytest.raises(StaleWeightsError, match="weight_version '7', expected '1'"):
            engine.generate(PROMPTS, 2, PARAMS, seed=3)
    finally:
        engine.update_weights_from_disk(ckpts["v0"], "0")


def test_a_server_refusing_the_weight_group_is_reported_at_once(servers) -> None:
    """One server refuses to join while the other waits in the rendezvous: the refusal is
    raised at once (not after the rendezvous' timeout), naming the server."""
    control(servers[0], "/_test/faults", {"refuse_weight_groups": 1})
    engine = engine_for(servers)
    port = free_port()
    start = time.monotonic()
    with pytest.raises(
        RolloutError, match=re.escape(f"{servers[0].url}/init_weights_update_group failed") + ".*injected refusal"
    ):
        engine.init_weights_update_group(
            "127.0.0.1",
            port,
            "refused",
            "gloo",
            join=lambda world_size: join_weight_update_group(
                backend="gloo",
                address="127.0.0.1",
                port=port,
                world_size=world_size,
                rank=0,
                group_name="refused",
                timeout_s=10,
            ),
        )
    assert time.monotonic() - start < 8  # (the join alone would wait its 10 s)
    assert "refused" not in control(servers[0], "/_test/stats")["weight_groups"]


def test_a_refused_weight_update_leaves_no_server_paused_or_in_a_session(servers) -> None:
    """One server refuses /begin_weight_update (a session was left open on it): the others'
    sessions are closed again and every server generates."""
    engine = engine_for(servers)
    assert control(servers[1], "/begin_weight_update")["success"]  # left open by someone else
    with pytest.raises(
        RolloutError, match=re.escape(f"{servers[1].url}/begin_weight_update failed") + ".*already open"
    ):
        with engine.weight_update("never"):
            raise AssertionError("the update body must not run")
    for server in servers:  # no session open anywhere, nobody paused
        assert control(server, "/begin_weight_update")["success"] and control(server, "/end_weight_update")["success"]
    assert len(engine.generate(PROMPTS[:1], 1, PARAMS, seed=1)) == 1


class CheckpointWeights:
    """A one-process :class:`moe_rl.rollout.weight_sync.base.WeightSource`: a checkpoint's tensors
    packed into buckets by the trainer's own planner."""

    def __init__(self, path: str) -> None:
        checkpoint = SafetensorsDir(path)
        self.tensors = {k: checkpoint.get(k) for k in sorted(checkpoint.keys())}
        self.entries = [WeightEntry(0, k, ((k, tuple(t.shape)),), t.dtype) for k, t in self.tensors.items()]

    def plan(self, bucket_bytes: int, dtype, *, per_stage: bool = False) -> list[Bucket]:
        return plan_buckets(self.entries, bucket_bytes, dtype)

    def stream(self, bucket_bytes: int, dtype, consume, *, per_stage: bool = False, every_rank=False) -> list[Bucket]:
        plan = self.plan(bucket_bytes, dtype)
        for bucket in plan:
            flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
            for name, place in bucket.unpack(flat):
                place.copy_(self.tensors[name])
            consume(bucket, flat)
        return plan


def test_buckets_are_packed_aligned_and_never_span_two_stages() -> None:
    """SGLang unpacks a flat bucket without padding: every tensor must start at a multiple of
    its element size. An odd-sized bf16 tensor before an fp32 one would not; the planner puts
    wider elements first. A pipeline stage's tensors go in buckets of their own, packed by
    that stage's sender; unpacking gives back every tensor exactly."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, generator=gen),
        "b.router.expert_bias": torch.randn(5, generator=gen),
        "c": torch.randn(2, 3, generator=gen),
        "d": torch.randn(7, generator=gen),
        "e.router.expert_bias": torch.randn(1, generator=gen),
    }
    stages = {"a": 0, "b.router.expert_bias": 0, "c": 0, "d": 1, "e.router.expert_bias": 1}
    entries = [WeightEntry(stages[k] * 2, k, ((k, tuple(t.shape)),), t.dtype, stages[k]) for k, t in tensors.items()]
    plan = plan_buckets(entries, 10**6, torch.bfloat16, senders=[0, 2])  # expert biases keep fp32
    assert [(b.stage, b.sender) for b in plan] == [(0, 0), (1, 2)]
    assert [[t.name for t in b.tensors] for b in plan] == [
        ["b.router.expert_bias", "a", "c"],
        ["e.router.expert_bias", "d"],
    ]
    for bucket in plan:
        assert all(t.start % t.dtype.itemsize == 0 for t in bucket.tensors)
        assert bucket.nbytes == sum(tensors[t.name].numel() * t.dtype.itemsize for t in bucket.tensors)
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
        for name, place in bucket.unpack(flat):
            place.copy_(tensors[name])
        for name, got in bucket.unpack(flat.clone()):
            assert torch.equal(got, tensors[name].to(got.dtype)) and got.dtype == (
                torch.float32 if "bias" in name else torch.bfloat16
            )
    # at most 20 bytes: a (6) | b (20) | c (12), then the stage ends | d (14) + e (4)
    assert [[t.name[0] for t in b.tensors] for b in plan_buckets(entries, 20, torch.bfloat16)] == [
        ["a"],
        ["b"],
        ["c"],
        ["e", "d"],
    ]


def test_distributed_update_reaches_both_servers_in_buckets(servers, ckpts) -> None:
    """Both servers join one gloo group (offsets 1 and 2) and receive v1's weights, each
    bucket one flat broadcast (the stand-in is SGLang 0.5.23); they then sample exactly what
    a local engine with v1 samples. Servers that report SGLang 0.5.5 (which reads a bucket
    tensor by tensor) get one broadcast per tensor, and v0's weights arrive as intact."""
    engine = engine_for(servers)
    sync = DistributedSync(engine, bucket_bytes=4096, dtype=torch.float32, backend="gloo", timeout_s=60)
    v1 = CheckpointWeights(ckpts["v1"])
    before = [control(s, "/_test/stats")["update_requests"] for s in servers]
    try:
        sync.push(v1, "1")
        buckets = len(v1.plan(4096, torch.float32))
        assert 1 < buckets == sync.broadcasts < len(v1.tensors)
        for server, earlier in zip(servers, before):
            requests = control(server, "/_test/stats")["update_requests"][len(earlier) :]
            assert requests == [{"group": sync.link.group_names[0], "flattened": True}] * buckets
        reference = LocalEngine(ckpts["v1"])
        assert [control(s, "/_test/weights_digest")["digest"] for s in servers] == [weights_digest(reference.model)] * 2
        got = engine.generate(PROMPTS, 2, PARAMS, seed=3)
        for group_got, group_want in zip(got, reference.generate(PROMPTS, 2, PARAMS, seed=3)):
            for s, ref in zip(group_got, group_want):
                assert s.output_ids == ref.output_ids and s.weight_version == "1"
                assert s.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-6)  # another process's kernels
        first = v1.plan(4096, torch.float32)[0]  # packed independently: its tensors' bytes one after another
        flat = torch.cat([v1.tensors[t.name].reshape(-1).view(torch.uint8) for t in first.tensors])
        with pytest.raises(RolloutError, match="weight update failed: weight update lacks"):  # half a model is refused
            with engine.weight_update("2"):
                engine.update_weights_from_distributed(
                    [(t.name, t.dtype, t.shape) for t in first.tensors],
                    lambda: sync._send(first, flat),
                    group_name=sync.link.group_names[0],
                    flattened=True,
                )
        assert engine.read_weight_version() == "incomplete-2"  # (SGLang would hold part of version 2)
        reply = httpx.post(servers[0].url + "/generate", json={"input_ids": [1, 2], "sampling_params": {}}, timeout=60)
        assert reply.json()["meta_info"]["weight_version"] == "incomplete-2"  # not left paused
    finally:
        sync.close()
    control(servers[1], "/_test/faults", {"server_version": "0.5.5"})
    older = DistributedSync(engine, bucket_bytes=4096, dtype=torch.float32, backend="gloo", timeout_s=60)
    try:
        older.push(CheckpointWeights(ckpts["v0"]), "0")
        assert older.broadcasts == len(v1.tensors) and not older.link.flattened
        assert [control(s, "/_test/weights_digest")["digest"] for s in servers] == [
            weights_digest(LocalEngine(ckpts["v0"]).model)
        ] * 2
    finally:
        older.close()
        control(servers[1], "/_test/faults", {})
        engine.update_weights_from_disk(servers[0].settings.model_path, "default")
    assert all(control(s, "/_test/stats")["weight_groups"] == [] for s in servers)


def test_a_prompts_samples_share_a_server_within_its_request_limit(servers) -> None:
    """Two servers, at most one request in flight on each: every prompt's samples go to one
    server (its prefix cache holds their prompt), prompts take the servers in turn."""
    for server in servers:
        control(server, "/_test/faults", {"delay_s": 0.05})  # (resets the in-flight count)
    before = [len(control(s, "/_test/stats")["generate_rids"]) for s in servers]
    engine = engine_for(servers, max_concurrency=2)
    engine.generate(PROMPTS * 2, 2, SamplingParams(max_new_tokens=1), seed=9)
    stats = [control(s, "/_test/stats") for s in servers]
    prompts_on = [sorted({int(rid.split("-")[3]) for rid in st["generate_rids"][n:]}) for st, n in zip(stats, before)]
    assert prompts_on == [[0, 2], [1, 3]] and [len(st["generate_rids"]) - n for st, n in zip(stats, before)] == [4, 4]
    assert [st["max_in_flight"] for st in stats] == [1, 1]
    for server in servers:
        control(server, "/_test/faults", {})


SCORED: list[str] = []  # what the reward below saw, in order, with the requests' answers


def _records_scoring(sample) -> float:
    SCORED.append("scored")
    return 1.0


def test_a_group_is_scored_while_a_later_one_still_generates(servers, monkeypatch) -> None:
    """Scoring as groups finish: prompt 1's requests are held until a reward has run, so
    the sampler must hand prompt 0's group to the scorer while prompt 1 is unanswered."""
    from moe_rl.rewards import RewardInput, RewardScorer, RewardSpec
    from moe_rl.rollout.single_turn import SingleTurnSampler

    SCORED.clear()
    engine = engine_for(servers)
    request = engine._request

    async def held(*args, rid: str, **kwargs):
        if rid.split("-")[3] == "1":  # moe-rl-{seed}-{prompt}-{sample}
            for _ in range(3000):  # 30 s, then the hold gives up (and the order below fails)
                if "scored" in SCORED:
                    break
                await asyncio.sleep(0.01)
        sample = await request(*args, rid=rid, **kwargs)
        SCORED.append(f"answered {rid}")
        return sample

    monkeypatch.setattr(engine, "_request", held)
    scorer = RewardScorer([RewardSpec("r", f"{__name__}:_records_scoring")], score_as_finished=True)
    pending = {}
    groups = SingleTurnSampler(engine).sample(
        [None, None],
        PROMPTS,
        2,
        PARAMS,
        seed=3,
        routed=False,
        on_group=lambda i, g: pending.setdefault(i, scorer.submit([RewardInput("q", "a", None)] * len(g))),
    )
    rewards = scorer.gather([pending[0], pending[1]])
    scorer.close()
    assert sorted(pending) == [0, 1] and [len(g) for g in groups] == [2, 2] and rewards.values.shape == (4, 1)
    first_scored = SCORED.index("scored")
    assert all(e.startswith("answered moe-rl-3-0-") for e in SCORED[:first_scored])  # only prompt 0 was answered
    assert sum(e.startswith("answered moe-rl-3-1-") for e in SCORED[first_scored:]) == 2


def test_more_requests_in_flight_than_httpxs_default_pool(servers) -> None:
    """concurrency_per_server above httpx's default pool of 100 connections: all 120 in
    flight at once (each held 1 s, then refused: no model runs)."""
    control(servers[0], "/_test/faults", {"delay_s": 1.0, "fail_status": 400, "fail_count": 1000})
    try:
        engine = engine_for(servers[:1], max_concurrency=120)
        with pytest.raises(RolloutError, match="HTTP 400"):
            engine.generate([[3, 4]] * 40, 3, SamplingParams(max_new_tokens=1), seed=1)
        assert control(servers[0], "/_test/stats")["max_in_flight"] == 120
    finally:
        control(servers[0], "/_test/faults", {})


def test_multi_turn_requests_keep_their_prompts_server() -> None:
    """A request that continues an earlier one's tokens (its next turn, or another sample of
    its prompt) goes to that one's server; others take the servers in turn."""
    turns = HttpTurns(SGLangEngine(["http://a", "http://b", "http://c"]), None, [], False, "v")
    assert [
        turns.server_for(ids)
        for ids in ([1, 2, 3], [1, 2, 3], [4, 5], [1, 2, 3, 9, 8], [4, 5, 6], [7], [1, 2], [1, 2, 3, 9])
    ] == [0, 0, 1, 0, 1, 2, 0, 0]


def test_prefix_hashes_follow_the_polynomial_recurrence() -> None:
    """The vectorised prefix hashes equal h_i = h_(i-1) * B + t_i (mod 2**64), token by token."""
    from moe_rl.rollout.sglang.turns import _HASH_BASE, prefix_hashes

    tokens = torch.randint(0, 151_936, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    expected, h = [], 0
    for t in tokens:
        h = (h * _HASH_BASE + t) % 2**64
        expected.append(h)
    assert prefix_hashes(tokens) == expected and prefix_hashes([]) == []


def test_weight_group_offsets_count_every_server_rank() -> None:
    assert weight_group_offsets([1, 1]) == ([1, 2], 3)
    assert weight_group_offsets([2, 1, 4]) == ([1, 3, 4], 8)


def test_killed_server_is_retried_elsewhere_or_reported(ckpts, tmp_path) -> None:
    dying, healthy = start_server(ckpts["v0"], tmp_path), start_server(ckpts["v0"], tmp_path)
    try:
        control(dying, "/_test/faults", {"die_after": 2})
        both = SGLangEngine([dying.url, healthy.url], max_retries=2, backoff_s=0.05)
        groups = both.generate(PROMPTS, 2, PARAMS, seed=2)
        assert all(len(s.output_ids) for g in groups for s in g) and both.retries >= 1
        assert dying.process.wait(timeout=10) == 1  # it really died mid-batch
        alone = SGLangEngine([dying.url], max_retries=2, backoff_s=0.05, connect_timeout_s=1, weight_version="default")
        start = time.monotonic()
        with pytest.raises(RolloutError, match="failed after 3 attempts.*ConnectError"):
            alone.generate(PROMPTS, 2, PARAMS, seed=2)
        assert time.monotonic() - start < 30, "a dead server must fail fast, never hang"
        with pytest.raises(RolloutError, match="not healthy after 1s"):
            alone.wait_healthy(timeout_s=1, poll_s=0.2)
    finally:
        dying.stop()
        healthy.stop()


def test_a_busy_port_is_refused_not_adopted(servers, tmp_path) -> None:
    busy = servers[0].settings.port
    settings = ServerSettings(model_path="x", port=busy, launch_command=[sys.executable, "-c", "pass"])
    with pytest.raises(RolloutError, match=f"port {busy} on 127.0.0.1 is already in use"):
        SGLangServer(settings, tmp_path)


def test_servers_before_0_5_23_are_asked_the_deprecated_info_names(servers) -> None:
    for server in servers:
        control(server, "/_test/faults", {"old_info_endpoints": True})
    try:
        assert httpx.get(servers[0].url + "/model_info").status_code == 404
        engine = engine_for(servers)
        assert (
            engine.read_weight_version() == "default"
            and engine.server_ranks() == [1, 1]
            and engine.returns_routed_experts()
        )
    finally:
        for server in servers:
            control(server, "/_test/faults", {})


def test_a_server_that_never_becomes_healthy_is_reported_with_its_log_tail(tmp_path) -> None:
    hang = [sys.executable, "-c", "import time; print('loading weights 3/7', flush=True); time.sleep(600)"]
    server = SGLangServer(ServerSettings(model_path="x", port=free_port(), launch_command=hang), tmp_path)
    with pytest.raises(
        RolloutError, match="not healthy after 2s \\(rollout.server.start_timeout_s\\)(.|\n)*loading weights 3/7"
    ):
        server.wait_healthy(timeout_s=2)
    assert server.process.poll() is not None  # stopped


def test_server_that_exits_at_start_is_reported_with_its_log(tmp_path) -> None:
    settings = ServerSettings(
        model_path="x",
        port=free_port(),
        launch_command=[sys.executable, "-c", "import sys; print('boom: no GPU'); sys.exit(3)"],
    )
    server = SGLangServer(settings, tmp_path)
    with pytest.raises(RolloutError, match="exited with code 3(.|\\n)*boom: no GPU"):
        server.wait_healthy(timeout_s=60)
    assert "--model-path" in settings.command() and "--enable-return-routed-experts" not in settings.command()


def test_close_aborts_only_this_engines_unanswered_requests(servers) -> None:
    before = control(servers[0], "/_test/stats")["aborted"]
    engine = engine_for(servers[:1])
    engine.generate(PROMPTS[:1], 1, PARAMS, seed=4)
    engine.close()  # everything answered: nothing to abort, other clients' requests untouched
    assert control(servers[0], "/_test/stats")["aborted"] == before
    engine._unfinished.add("moe-rl-4-0-0")  # as an interrupt leaves a request running
    engine.close()
    assert control(servers[0], "/_test/stats")["aborted"] == [*before, {"rid": "moe-rl-4-0-0"}]


@pytest.mark.parametrize("fault", ["error_body", "null_logprob", "abort", "expert_out_of_range", "expert_repeated"])
def test_wrong_replies_are_retried_then_reported(servers, fault: str) -> None:
    url = servers[0].url
    engine = SGLangEngine([url], num_layers=2, top_k=2, num_experts=4, max_retries=2, backoff_s=0.01)
    control(servers[0], "/_test/faults", {"reply_fault": fault, "reply_fault_count": 1})
    ((sample,),) = engine.generate(PROMPTS[:1], 1, PARAMS, seed=6, return_routed_experts=True)
    assert engine.retries == 1 and sample.finish_reason in ("stop", "length") and sample.output_logprobs[0] is not None
    control(servers[0], "/_test/faults", {"reply_fault": fault, "reply_fault_count": 5})
    with pytest.raises(RolloutError, match="failed after 3 attempts"):
        engine.generate(PROMPTS[:1], 1, PARAMS, seed=6, return_routed_experts=True)
    control(servers[0], "/_test/faults", {})


def test_local_engine_in_process_weight_update_equals_disk(ckpts) -> None:
    from moe_rl.models.hf_weights import SafetensorsDir

    engine = LocalEngine(ckpts["v0"])
    reader = SafetensorsDir(ckpts["v1"])
    engine.update_weights({k: reader.get(k) for k in reader.keys()}, "1")
    got = engine.generate(PROMPTS, 2, PARAMS, seed=9)
    ref = LocalEngine(ckpts["v1"]).generate(PROMPTS, 2, PARAMS, seed=9)
    assert [[s.output_ids for s in g] for g in got] == [[s.output_ids for s in g] for g in ref]
    assert engine.weight_version == "1"
    with pytest.raises(ValueError, match="lacks"):
        engine.update_weights({}, "2")


def test_local_engine_draws_follow_the_filtered_distribution() -> None:
    import numpy as np

    from moe_rl.rollout.local import _draw, _filtered_probs, _uniforms

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    probs = _filtered_probs(logits, top_p=0.9, top_k=3)  # token 3 and one more are cut
    draws = torch.cat(
        [_draw(probs, _uniforms(np.array([seed], dtype=np.uint64), step)) for seed in range(400) for step in range(50)]
    )
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    assert torch.all(freq[probs[0] == 0] == 0)  # never a truncated token
    torch.testing.assert_close(freq, probs[0].double(), atol=0.015, rtol=0)  # 20,000 draws: ~3 standard errors
    # one row's stream depends only on its seed and step: not on the rows beside it
    alone = _uniforms(np.array([7], dtype=np.uint64), 3)
    batch = _uniforms(np.array([1, 7, 99], dtype=np.uint64), 3)
    assert alone[0] == batch[1] and len(set(batch.tolist())) == 3 and torch.all((batch >= 0) & (batch < 1))


def test_local_engine_sample_does_not_depend_on_its_batch(ckpts) -> None:
    engine = LocalEngine(ckpts["v0"])
    together = engine.generate_rows([[1, 2, 3], [4, 5, 6], [1, 2, 3]], [5, 6, 7], PARAMS, routed=False)
    alone = engine.generate_rows([[4, 5, 6]], [6], PARAMS, routed=False)
    assert together[1].output_ids == alone[0].output_ids
    torch.testing.assert_close(
        torch.tensor(together[1].output_logprobs), torch.tensor(alone[0].output_logprobs), atol=1e-5, rtol=0
    )
    assert (
        together[0].output_ids != together[2].output_ids or together[0].output_logprobs != together[2].output_logprobs
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.distributed
def test_local_engine_matches_the_trainer(ckpts, temperature) -> None:
    script = SUPPORT / "rollout_parity_checks.py"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), ckpts["v0"], str(temperature)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["max_diff"] <= 1e-4
    assert result["routing_equal"] and result["positions"] > 0


def test_a_slow_server_times_out_and_is_reported(servers) -> None:
    control(servers[0], "/_test/faults", {"delay_s": 3})
    try:
        engine = SGLangEngine([servers[0].url], timeout_s=0.5, max_retries=1, backoff_s=0.01)
        start = time.monotonic()
        with pytest.raises(RolloutError, match="failed after 2 attempts.*ReadTimeout"):
            engine.generate(PROMPTS[:1], 1, PARAMS, seed=1)
        assert time.monotonic() - start < 20
    finally:
        control(servers[0], "/_test/faults", {})


def test_servers_without_routing_refuse_r3_and_skip_drift_metrics(servers, ckpts, tmp_path, caplog) -> None:
    import logging

    from moe_rl.config import load_config
    from moe_rl.experience.builders import use_engine_routing

    assert engine_for(servers).returns_routed_experts()  # started with the flag
    assert use_engine_routing(load_config(None, []), engine_for(servers))  # routing metrics on: asked for
    plain = SGLangServer(ServerSettings(model_path=ckpts["v0"], port=free_port(), launch_command=SERVER), tmp_path)
    try:
        plain.wait_healthy(timeout_s=120)
        engine = SGLangEngine([plain.url])
        assert engine.servers_without_routed_experts() == [plain.url]
        with pytest.raises(RolloutError, match="r3 needs .*--enable-return-routed-experts"):
            use_engine_routing(load_config(None, ["routing.replay=r3"]), engine)
        with caplog.at_level(logging.WARNING, logger="moe_rl.train"):
            assert not use_engine_routing(load_config(None, []), engine)  # metrics go on without train/rollout drift
        assert "routing/train_vs_rollout" in caplog.text and "--enable-return-routed-experts" in caplog.text
        assert not use_engine_routing(load_config(None, ["routing.metrics=false"]), engine)
    finally:
        plain.stop()


def _gone(pid: int) -> bool:
    """The process exited (no /proc entry, or a zombie waiting to be reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] in ("Z", "X") and int(fields[17]) <= 1
    except OSError:
        return True


def test_a_launched_server_never_outlives_its_owner(ckpts, tmp_path) -> None:
    # the owner is killed with -9: the server gets SIGTERM (a parent-death signal)
    owner_code = (
        "import time\n"
        "from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer\n"
        f"s = SGLangServer(ServerSettings(model_path={ckpts['v0']!r}, port={free_port()}, launch_command={SERVER!r}), {str(tmp_path)!r})\n"
        "s.wait_healthy(timeout_s=120)\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    pid = int(owner.stdout.readline())
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the server outlived the trainer that started it"
    # a server an earlier owner left behind (its pid file) is stopped by the next start on its
    # port; here a stand-in that only holds the port (a test server takes seconds to start)
    port = free_port()
    holder = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); print(1, flush=True); time.sleep(600)"
    stale_command = [sys.executable, "-c", holder]
    stale = subprocess.Popen(stale_command, start_new_session=True, stdout=subprocess.PIPE, text=True)
    stale.stdout.readline()  # listening
    pid_file = tmp_path / f"sglang-{port}.pid"
    pid_file.write_text(json.dumps({"pid": stale.pid, "command": stale_command}))
    # not "port in use"
    server = SGLangServer(ServerSettings(model_path=ckpts["v0"], port=port, launch_command=SERVER), tmp_path)
    try:
        assert stale.poll() == -signal.SIGTERM
        assert json.loads(pid_file.read_text())["pid"] == server.process.pid
    finally:
        server.stop()
    assert not pid_file.exists()
    # a pid file whose process is another program now (the pid was reused) is left alone
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pid_file.write_text(json.dumps({"pid": other.pid, "command": stale_command}))
        stop_stale_server(pid_file)
        assert other.poll() is None and not pid_file.exists()
    finally:
        other.kill()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.distributed
def test_cuda_tensors_travel_as_ipc_handles_naming_their_gpu_by_uuid(tmp_path) -> None:
    """The tensor sync's payload names a CUDA tensor's device by UUID (as SGLang's patched
    reductions do: a server rank numbers the GPUs its own way), and another process maps the
    same memory from it."""
    import base64

    from moe_rl.rollout.weight_sync.cuda_ipc import serialize_for_sglang

    flat = torch.arange(1000, dtype=torch.float32, device="cuda").view(torch.uint8)
    payload = serialize_for_sglang({"flattened_tensor": flat, "metadata": []})
    uuid = str(torch.cuda.get_device_properties(flat.device).uuid)
    assert uuid.encode() in base64.b64decode(payload)
    (tmp_path / "payload").write_text(payload)
    child = (
        "import sys, torch; from moe_rl.rollout.weight_sync.cuda_ipc import deserialize_sglang_payload; "
        "t = deserialize_sglang_payload(open(sys.argv[1]).read())['flattened_tensor']; print(t.view(torch.float32).sum().item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "payload")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == float(sum(range(1000)))


def test_a_reply_slower_than_the_configs_request_timeout_is_retried_then_fatal(servers, ckpts) -> None:
    """rollout.server.request_timeout_s is the engine's read timeout (600 s was fixed in code:
    a long reasoning response, queued behind others, stopped the run): a reply slower than it
    times out and is retried; one within it is a sample."""
    import contextlib

    from moe_rl.config import load_config
    from moe_rl.experience.builders import build_engine
    from moe_rl.models.architectures import load_hf_config

    cfg = load_config(
        None,
        ["rollout.engine=sglang", f"rollout.server.urls=[{servers[0].url}]", "rollout.server.request_timeout_s=0.4"],
    )
    control(servers[0], "/_test/faults", {"delay_s": 0.8})
    try:
        with contextlib.ExitStack() as closing:
            engine = build_engine(cfg, ckpts["v0"], load_hf_config(ckpts["v0"]), closing)
            assert engine.timeout.read == 0.4
            engine.max_retries, engine.backoff_s = 1, 0.01
            with pytest.raises(RolloutError, match="ReadTimeout"):
                engine.generate(PROMPTS[:1], 1, PARAMS, seed=1)
            engine.timeout = httpx.Timeout(5.0, connect=1.0)
            assert len(engine.generate(PROMPTS[:1], 1, PARAMS, seed=1)[0]) == 1
    finally:
        control(servers[0], "/_test/faults", {})


def test_partial_rollouts_abort_a_retried_request_on_the_server_it_moved_to(servers) -> None:
    """The long request's first server answers 503, so it is retried on the other one; when
    the quick group is done, its aborts go where it now runs (they went to the first
    server, and it ran its 200 tokens)."""
    import dataclasses

    from moe_rl.rollout.types import GenerationRequest

    greedy = SamplingParams(max_new_tokens=200, temperature=1.0, top_k=1, ignore_eos=True)
    quick = dataclasses.replace(greedy, max_new_tokens=12)
    control(servers[0], "/_test/faults", {"fail_status": 503, "fail_count": 1, "token_delay_s": 0.005})
    control(servers[1], "/_test/faults", {"token_delay_s": 0.005})
    try:
        engine = engine_for(servers, num_experts=8)
        engine.backoff_s = 0.01
        long, short = GenerationRequest(PROMPTS[0], seed=3, group=0), GenerationRequest(PROMPTS[1], seed=4, group=1)
        first, done = engine.generate_requests([long, short], [greedy, quick], routed=True, groups_needed=1)
        assert engine.retries == 1 and done.finish_reason == "length"
        assert first.finish_reason == "abort" and len(first.output_ids) < greedy.max_new_tokens // 2
        assert [a["rid"] for a in control(servers[1], "/_test/stats")["aborted"]]
    finally:
        for server in servers:
            control(server, "/_test/faults", {})


def test_an_aborted_reply_without_routing_drops_its_tokens_instead_of_stopping_the_run() -> None:
    """SGLang's reply to a request aborted while retracted to its waiting queue (KV cache
    full) has tokens and no routed_experts: under R3 those tokens cannot be trained on, so
    the partial response keeps only its earlier segments; a finished reply without routing
    is still the server's configuration error."""
    engine = SGLangEngine(["http://a"], num_layers=2, top_k=2, num_experts=8)
    engine._aborting.add("moe-rl-partial-0-0-3.")
    meta = {"output_token_logprobs": [[-0.5, 7, None], [-0.1, 9, None]], "weight_version": "v"}
    reply = {"output_ids": [7, 9], "meta_info": {**meta, "finish_reason": {"type": "abort"}}}
    kwargs = {"routed": True, "expected_version": "v", "rid": "moe-rl-partial-0-0-3."}
    sample = engine._parse([1, 2, 3], 3, reply, **kwargs)
    assert sample.finish_reason == "abort" and sample.output_ids == [] and sample.output_logprobs == []
    finished = {"output_ids": [7, 9], "meta_info": {**meta, "finish_reason": {"type": "length"}}}
    with pytest.raises(RolloutError, match="enable-return-routed-experts"):
        engine._parse([1, 2, 3], 3, finished, **kwargs)


def test_requests_aborted_by_close_are_not_retried() -> None:
    """close() (a stopping run) aborts what is still running: those requests' "abort"
    replies are final, not retried in full on the next server."""
    engine = SGLangEngine(["http://127.0.0.1:9"], num_layers=2, top_k=2)  # nothing listens: the abort is lost
    engine._unfinished.add("moe-rl-7-0-1")
    engine.close()
    reply = {
        "output_ids": [7],
        "meta_info": {"output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "abort"}},
    }
    sample = engine._parse([1, 2], 1, reply, routed=False, expected_version="", rid="moe-rl-7-0-1")
    assert sample.finish_reason == "abort" and sample.output_ids == [7]
