"""One protocol, two servers: each test runs against real SGLang 0.5.23 (CPU backend) and
against the project's stand-in (``tests/support/sglang_test_server.py``), so a difference between
them shows here. The stand-in stays for the fast tests and for faults a real server cannot
be made to show; what it answers must be what the real one answers."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from conftest import demo_model_dir, demo_weights_on
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
    reply = post(
        server,
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": GREEDY,
            "return_logprob": True,
            "logprob_start_len": len(PROMPT),
            "rid": "conformance-1",
        },
    )
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
    assert [e[1] for e in entries] == output and all(
        isinstance(e[0], float) and e[0] <= 0 and e[2] is None for e in entries
    )


def test_routed_experts_cover_every_position_but_the_last(server):
    reply = post(
        server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}
    ).json()
    # the built-in model: 2 layers, top-2 of 8
    experts = decode_routed_experts(reply["meta_info"]["routed_experts"], 2, 2)
    assert experts.shape == (len(PROMPT) + len(reply["output_ids"]) - 1, 2, 2)
    assert int(experts.min()) >= 0 and int(experts.max()) < 8 and bool((experts[..., 0] != experts[..., 1]).all())


def test_routed_experts_from_a_start_position(server):
    """``routed_experts_start_len`` (what a multi-turn client asks for after its first
    turn): the rows from that position on; past the input, HTTP 400."""
    full = post(
        server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True}
    ).json()
    part = post(
        server,
        "/generate",
        {"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True, "routed_experts_start_len": 3},
    ).json()
    whole, tail = (decode_routed_experts(r["meta_info"]["routed_experts"], 2, 2) for r in (full, part))
    assert part["output_ids"] == full["output_ids"] and torch.equal(tail, whole[3:])
    refused = post(
        server,
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": GREEDY,
            "return_routed_experts": True,
            "routed_experts_start_len": len(PROMPT) + 1,
        },
    )
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
    model_info, old_model_info = (
        httpx.get(server.url + p, timeout=30).json() for p in ("/model_info", "/get_model_info")
    )
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


def test_a_weight_update_labels_the_servers_only_when_it_completed(server):
    """The new ``weight_version`` is set once every bucket has been loaded (SGLang loads each
    bucket as it arrives: a label sent with one would name half-new weights); an update that
    failed before any bucket leaves the label and the server generating again (one that
    failed after a bucket: ``incomplete-<version>``, tests/server/test_rollout.py)."""
    from moe_rl.rollout.sglang.engine import SGLangEngine

    engine = SGLangEngine([server.url])
    with engine.weight_update("whole"):
        pass
    assert engine.read_weight_version() == "whole"
    with pytest.raises(RuntimeError, match="failed before any bucket"):
        with engine.weight_update("next"):
            raise RuntimeError("failed before any bucket")
    assert engine.read_weight_version() == "whole"  # no bucket went out: its weights are whole
    reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert reply["meta_info"]["weight_version"] == "whole"  # not left paused


def test_an_abort_before_its_request_is_dropped_and_one_after_it_stops_it(server):
    """What the client's repeated aborts rely on: an ``/abort_request`` for a rid the server
    does not know yet is dropped (the request, sent after it, runs to its end), and leaves
    nothing behind: a repeat once the request runs stops it with the tokens it had."""
    long = {"max_new_tokens": 240, "temperature": 1.0, "top_k": 1, "ignore_eos": True}
    stand_in = httpx.post(server.url + "/_test/faults", json={"token_delay_s": 0.005}, timeout=10).status_code == 200
    try:
        with ThreadPoolExecutor(1) as pool:
            finishes = []
            for rid, repeat in (("conformance-early.", False), ("conformance-repeated.", True)):
                assert post(server, "/abort_request", {"rid": rid}).status_code == 200
                reply = pool.submit(
                    post, server, "/generate", {"input_ids": PROMPT, "sampling_params": long, "rid": rid}
                )
                while repeat and not reply.done():
                    time.sleep(0.05)
                    post(server, "/abort_request", {"rid": rid})
                body = reply.result().json()
                finishes.append((body["meta_info"]["finish_reason"]["type"], len(body["output_ids"])))
    finally:
        if stand_in:
            httpx.post(server.url + "/_test/faults", json={}, timeout=10)
    (early, n_early), (repeated, n_repeated) = finishes
    assert (early, n_early) == ("length", 240)
    assert repeated == "abort" and n_repeated < 240, finishes


def test_update_from_disk_sets_the_version_and_refuses_a_bad_path(server, demo_cache):
    bad = post(server, "/update_weights_from_disk", {"model_path": "/nonexistent/model", "weight_version": "bad"})
    assert bad.status_code == 400 and bad.json()["success"] is False
    demo_weights_on(server, demo_cache, version="v-disk")
    assert httpx.get(server.url + "/model_info", timeout=30).json()["weight_version"] == "v-disk"
    reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert reply["meta_info"]["weight_version"] == "v-disk"


def test_a_bucket_arrives_as_one_flat_broadcast_through_either_group(server, demo_cache, tmp_path):
    """``load_format="flattened_bucket"``: a bucket's tensors arrive as one broadcast of their
    bytes, one after another, from rank 0 of either of two weight-update groups the server
    joined (a pipeline stage's sender each); the server then serves what it serves after
    loading those weights from disk. A tensor at a byte offset that is not a multiple of its
    element size is refused before anything is received."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moe_rl.rollout.sglang.engine import SGLangEngine
    from parallel.launch import free_port
    from parallel.weight_update_group import join_weight_update_group, leave_weight_update_group

    changed = tmp_path / "changed"
    shutil.copytree(demo_model_dir(demo_cache), changed)
    (weights_file,) = changed.glob("*.safetensors")
    tensors = load_file(weights_file)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        k: torch.randn(v.shape, generator=gen) if k.endswith(("lm_head.weight", "embed_tokens.weight")) else v
        for k, v in tensors.items()
    }
    save_file(tensors, weights_file, metadata={"format": "pt"})
    prompts = {
        "input_ids": [PROMPT, [9, 4, 2], [1, 5, 7, 3, 8]],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
    }
    before = [r["output_ids"] for r in post(server, "/generate", prompts).json()]
    assert (
        post(
            server, "/update_weights_from_disk", {"model_path": str(changed), "weight_version": "from-disk"}
        ).status_code
        == 200
    )
    from_disk = [r["output_ids"] for r in post(server, "/generate", prompts).json()]
    assert from_disk != before  # the new weights show
    demo_weights_on(server, demo_cache)

    engine, groups, names = SGLangEngine([server.url]), [], sorted(tensors)
    try:
        for name in ("flat-a", "flat-b"):
            port = free_port()
            join = lambda world_size, port=port, name=name: join_weight_update_group(  # noqa: E731
                backend="gloo",
                address="127.0.0.1",
                port=port,
                world_size=world_size,
                rank=0,
                group_name=name,
                timeout_s=120,
            )
            groups.append(engine.init_weights_update_group("127.0.0.1", port, name, "gloo", join))
        with engine.weight_update("flat"):
            for group, name, part in zip(groups, ("flat-a", "flat-b"), (names[::2], names[1::2])):
                flat = torch.cat([tensors[k].reshape(-1).view(torch.uint8) for k in part])
                engine.update_weights_from_distributed(
                    [(k, tensors[k].dtype, tensors[k].shape) for k in part],
                    lambda flat=flat, group=group: torch.distributed.broadcast(flat, group=group, group_src=0),
                    group_name=name,
                    flattened=True,
                )
            unaligned = {
                "names": ["a", "b"],
                "dtypes": ["bfloat16", "float32"],
                "shapes": [[3], [1]],
                "group_name": "flat-a",
                "load_format": "flattened_bucket",
                "flush_cache": False,
            }
            refused = post(server, "/update_weights_from_distributed", unaligned)
            assert refused.status_code == 400 and refused.json()["success"] is False
            assert "Unaligned received tensor b: byte offset 6, dtype torch.float32" in refused.json()["message"]
        assert [r["output_ids"] for r in post(server, "/generate", prompts).json()] == from_disk
        assert (
            post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()["meta_info"][
                "weight_version"
            ]
            == "flat"
        )
    finally:
        for name in ("flat-a", "flat-b"):
            engine.destroy_weights_update_group(name)
        for group in groups:
            leave_weight_update_group(group)
        demo_weights_on(server, demo_cache)
