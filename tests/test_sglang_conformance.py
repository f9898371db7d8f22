"""One protocol, two servers: each test runs against real SGLang 0.5.23 (CPU backend) and
against the project's stand-in (``tests/sglang_test_server.py``), so a difference between
them shows here. The stand-in stays for the fast tests and for faults a real server cannot
be made to show; what it answers must be what the real one answers."""

from __future__ import annotations

import httpx
import pytest
import torch

from conftest import demo_weights_on
from moe_rl.routing.encoding import decode_routed_experts

PROMPT = [3, 7, 5, 12]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


@pytest.fixture(params=["stand_in", pytest.param("real", marks=pytest.mark.real_sglang)])
def server(request, demo_cache):
    """Each server in turn, serving the built-in model's weights as version ``demo``."""
    served = request.getfixturevalue("real_sglang" if request.param == "real" else "stand_in_sglang")
    demo_weights_on(served, demo_cache)
    return served


def post(server, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body or {}, timeout=120)


def test_generate_reply_has_the_fields_the_client_reads(server):
    reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
                                       "logprob_start_len": len(PROMPT), "rid": "conformance-1"})  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    meta, output = body["meta_info"], body["output_ids"]
    assert {"text", "output_ids", "meta_info"} <= set(body)
    assert meta["id"] == "conformance-1"
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(output) >= 1
    assert meta["weight_version"] == "demo" and meta["weight_versions"][0]["version"] == "demo"
    assert meta["input_token_logprobs"] == []
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == output and all(isinstance(e[0], float) and e[0] <= 0 and e[2] is None for e in entries)


def test_routed_experts_cover_every_position_but_the_last(server):
    reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}).json()
    experts = decode_routed_experts(reply["meta_info"]["routed_experts"], 2, 2)  # the built-in model: 2 layers, top-2 of 8
    assert experts.shape == (len(PROMPT) + len(reply["output_ids"]) - 1, 2, 2)
    assert int(experts.min()) >= 0 and int(experts.max()) < 8 and bool((experts[..., 0] != experts[..., 1]).all())


def test_routed_experts_from_a_start_position(server):
    """``routed_experts_start_len`` (what a multi-turn client asks for after its first
    turn): the rows from that position on; past the input, HTTP 400."""
    full = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}).json()
    part = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True,
                                      "routed_experts_start_len": 3}).json()  # fmt: skip
    whole, tail = (decode_routed_experts(r["meta_info"]["routed_experts"], 2, 2) for r in (full, part))
    assert part["output_ids"] == full["output_ids"] and torch.equal(tail, whole[3:])
    refused = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True,
                                         "routed_experts_start_len": len(PROMPT) + 1})  # fmt: skip
    assert refused.status_code == 400 and "routed_experts_start_len" in refused.json()["error"]["message"]


def test_a_list_of_prompts_gets_a_list_of_replies(server):
    replies = post(server, "/generate", {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": GREEDY}).json()
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [len(PROMPT), 2]


def test_unknown_sampling_params_are_refused(server):
    reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "bogus_key": 1}})
    assert reply.status_code == 400 and "bogus_key" in reply.text


def test_online_weight_updates_need_a_session(server):
    announce = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"}
    outside = post(server, "/update_weights_from_distributed", announce)
    assert outside.status_code == 400 and outside.json()["success"] is False
    assert post(server, "/end_weight_update").status_code == 400  # none open
    begun = post(server, "/begin_weight_update")
    assert begun.status_code == 200 and begun.json()["success"] is True
    try:
        assert post(server, "/begin_weight_update").status_code == 400  # one at a time
    finally:
        ended = post(server, "/end_weight_update")
    assert ended.status_code == 200 and ended.json()["success"] is True


def test_info_endpoints_new_and_deprecated_names(server):
    model_info, old_model_info = (httpx.get(server.url + p, timeout=30).json() for p in ("/model_info", "/get_model_info"))
    assert model_info["weight_version"] == old_model_info["weight_version"] == "demo"
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert (info["tp_size"], info["dp_size"], info["pp_size"], info["enable_return_routed_experts"]) == (1, 1, 1, True)
    assert info["version"] == "0.5.23"


def test_control_endpoints(server):
    assert post(server, "/pause_generation").json()["status"] == "ok"
    assert post(server, "/continue_generation").json()["status"] == "ok"
    flushed = post(server, "/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    aborted = post(server, "/abort_request", {"rid": "no-such-request"})
    assert aborted.status_code == 200 and aborted.content == b""
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.url + "/no_such_route", timeout=30).status_code == 404
    destroyed = post(server, "/destroy_weights_update_group", {"group_name": "never-made"})
    assert destroyed.status_code == 400 and destroyed.json()["success"] is False


def test_update_from_disk_sets_the_version_and_refuses_a_bad_path(server, demo_cache):
    bad = post(server, "/update_weights_from_disk", {"model_path": "/nonexistent/model", "weight_version": "bad"})
    assert bad.status_code == 400 and bad.json()["success"] is False
    demo_weights_on(server, demo_cache, version="v-disk")
    assert httpx.get(server.url + "/model_info", timeout=30).json()["weight_version"] == "v-disk"
    reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert reply["meta_info"]["weight_version"] == "v-disk"
