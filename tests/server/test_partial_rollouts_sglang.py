"""Partial rollouts against the SGLang stand-in and real SGLang 0.5.23 on CPU: a request
aborted once enough groups are done replies with the tokens, log-probs and routing it had;
continued after a weight update from prompt + partial response it ends where the
uninterrupted request does, each segment with its own weight version, the routing joined
exactly (the continuation's prefill returns none). Greedy (``top_k=1``): a real server's
``sampling_seed`` does not reproduce on CPU."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch

from conftest import demo_model_dir, demo_weights_on, require_real_sglang
from moe_rl.rollout.partial import PartialRollout, joined
from moe_rl.rollout.sglang.engine import SGLangEngine
from moe_rl.rollout.types import GenerationRequest, SamplingParams, Segment

GREEDY = SamplingParams(max_new_tokens=200, temperature=1.0, top_k=1, ignore_eos=True)
QUICK = dataclasses.replace(GREEDY, max_new_tokens=12)
SHORT_PROMPT, LONG_PROMPT = [6, 13, 7, 16], [9, 13, 5, 16]


@pytest.fixture(params=["stand_in", pytest.param("real", marks=pytest.mark.real_sglang)])
def server(request, demo_cache):
    if request.param == "real":
        require_real_sglang()
        server = request.getfixturevalue("real_sglang")
    else:
        server = request.getfixturevalue("stand_in_sglang")
        # a decode time per token, as a real engine has: the long request is still running when aborted
        httpx.post(server.url + "/_test/faults", json={"token_delay_s": 0.005}, timeout=10)
    yield server
    if request.param == "stand_in":
        httpx.post(server.url + "/_test/faults", json={}, timeout=10)
    demo_weights_on(server, demo_cache)  # the session's other tests expect the demo weights as "demo"


def stand_in(server) -> bool:
    return any("sglang_test_server" in part for part in server.settings.launch_command)


def test_an_aborted_request_continues_after_a_weight_update_to_its_uninterrupted_end(server, demo_cache) -> None:
    engine = SGLangEngine([server.url], num_layers=2, top_k=2, num_experts=8)
    engine.update_weights_from_disk(demo_model_dir(demo_cache), "p1")
    reference = GenerationRequest(LONG_PROMPT, seed=3, group=0)
    (whole,) = engine.generate_requests([reference], [GREEDY], routed=True, groups_needed=1)
    assert whole.finish_reason == "length" and len(whole.output_ids) == GREEDY.max_new_tokens

    long, quick = reference, GenerationRequest(SHORT_PROMPT, seed=4, group=1)
    first, done = engine.generate_requests([long, quick], [GREEDY, QUICK], routed=True, groups_needed=1)
    assert done.finish_reason == "length" and len(done.output_ids) == QUICK.max_new_tokens
    m = len(first.output_ids)
    assert first.finish_reason == "abort" and 0 < m < GREEDY.max_new_tokens, (first.finish_reason, m)
    assert first.weight_version == "p1" and first.routed_experts.shape[0] == len(LONG_PROMPT) + m - 1

    engine.update_weights_from_disk(demo_model_dir(demo_cache), "p2")  # the same weights, a new version
    cont = GenerationRequest(LONG_PROMPT + first.output_ids, long.seed, 0, generated=m)
    rest = dataclasses.replace(GREEDY, max_new_tokens=GREEDY.max_new_tokens - m)
    (second,) = engine.generate_requests([cont], [rest], routed=True, groups_needed=1)
    assert second.weight_version == "p2" and second.finish_reason == "length"
    result = joined(first, second)

    assert result.output_ids == whole.output_ids
    assert result.segments == (Segment(0, "p1"), Segment(m, "p2"))
    assert result.token_versions() == ["p1"] * m + ["p2"] * (GREEDY.max_new_tokens - m)
    assert result.output_logprobs[:m] == first.output_logprobs  # each segment's own, unchanged
    # the stand-in computes in fp32; real SGLang in bf16, where the continuation's prefill of
    # the earlier tokens (its cache flushed by the update) rounds unlike their decode did
    tolerance = 1e-5 if stand_in(server) else 1e-2
    assert result.output_logprobs == pytest.approx(whole.output_logprobs, abs=tolerance)
    assert torch.equal(result.routed_experts, whole.routed_experts)


def test_requests_never_sent_return_no_tokens(server, demo_cache) -> None:
    """With one request in flight at a time, the quota met by the first leaves the second
    unsent: it returns aborted with no tokens (and is not sent at all)."""
    engine = SGLangEngine([server.url], num_layers=2, top_k=2, num_experts=8, max_concurrency=1)
    first, second = engine.generate_requests(
        [GenerationRequest(SHORT_PROMPT, 1, 0), GenerationRequest(LONG_PROMPT, 2, 1)],
        [QUICK, GREEDY],
        routed=True,
        groups_needed=1,
    )
    assert first.finish_reason == "length" and len(first.output_ids) == QUICK.max_new_tokens
    assert second.finish_reason == "abort" and second.output_ids == [] and second.prompt_ids == LONG_PROMPT


def test_a_carried_response_past_the_staleness_bound_starts_over_on_the_server(stand_in_sglang, demo_cache) -> None:
    """PartialRollout over the stand-in: responses stopped at step 0 and carried over two
    weight updates are too old for step 2 under ``max_staleness=1``: generated anew there,
    every trained token of step 2's weights."""
    server = stand_in_sglang
    httpx.post(server.url + "/_test/faults", json={"token_delay_s": 0.005}, timeout=10)
    try:
        engine = SGLangEngine([server.url], num_layers=2, top_k=2, num_experts=8)
        engine.update_weights_from_disk(demo_model_dir(demo_cache), "0")
        rollout = PartialRollout(engine, group_size=4, groups_per_step=1, extra_groups=3, max_staleness=1)
        long_tailed = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True, stop_token_ids=(5, 9))
        prompts = [SHORT_PROMPT, LONG_PROMPT, SHORT_PROMPT[::-1], LONG_PROMPT[::-1]]
        rollout.sample(list(range(4)), prompts, long_tailed, seed=1, step=0, routed=True)
        started = sum(1 for g in rollout.carried for s in g.samples if s.output_ids and s.finish_reason == "abort")
        assert started > 0, "no response was stopped with tokens"
        kept = sum(1 for g in rollout.carried for s in g.samples if s.output_ids)  # stopped ones and done ones
        engine.update_weights_from_disk(demo_model_dir(demo_cache), "1")
        engine.update_weights_from_disk(demo_model_dir(demo_cache), "2")
        got = rollout.sample([], [], long_tailed, seed=1, step=2, routed=True)
        assert got.restarted == kept
        for group in got.groups:
            for s in group:
                assert (
                    set(s.token_versions()) == {"2"}
                    and s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.output_ids) - 1
                )
    finally:
        httpx.post(server.url + "/_test/faults", json={}, timeout=10)
        demo_weights_on(server, demo_cache)


def test_an_abort_that_arrives_before_its_request_is_sent_again(stand_in_sglang, demo_cache) -> None:
    """The long request reaches the server after its abort (a late connection, a retry's
    backoff), which SGLang drops (the rid unknown): the abort is repeated until the request
    answers, so it stops early instead of running its 200 tokens (a second without it)."""
    server = stand_in_sglang
    late = {"token_delay_s": 0.005, "late_seeds": {"3": 0.15}}  # the quick one is done in ~0.06 s
    httpx.post(server.url + "/_test/faults", json=late, timeout=10)
    try:
        engine = SGLangEngine([server.url], num_layers=2, top_k=2, num_experts=8)
        engine.update_weights_from_disk(demo_model_dir(demo_cache), "p1")
        long, quick = GenerationRequest(LONG_PROMPT, seed=3, group=0), GenerationRequest(SHORT_PROMPT, 4, 1)
        before = len(httpx.get(server.url + "/_test/stats", timeout=10).json()["aborted"])
        first, done = engine.generate_requests([long, quick], [GREEDY, QUICK], routed=True, groups_needed=1)
        assert done.finish_reason == "length" and len(done.output_ids) == QUICK.max_new_tokens
        assert first.finish_reason == "abort" and len(first.output_ids) < GREEDY.max_new_tokens // 2
        aborted = httpx.get(server.url + "/_test/stats", timeout=10).json()["aborted"][before:]
        assert len(aborted) >= 2 and {a["rid"] for a in aborted} == {aborted[0]["rid"]}, aborted  # one, repeated
    finally:
        httpx.post(server.url + "/_test/faults", json={}, timeout=10)
        demo_weights_on(server, demo_cache)
