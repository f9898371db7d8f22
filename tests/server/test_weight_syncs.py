"""Weight syncs that go wrong: a server refusing a bucket, or never joining or receiving,
stops the push within seconds with the server's message (not after the weight-update
group's timeout); an NCCL group is refused before it is joined when the two sides' NCCLs
differ; an attached URL nobody listens on is reported at once."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

from moe_rl.models.tiny import save_tiny_checkpoint
from moe_rl.rollout.sglang.engine import SGLangEngine
from moe_rl.rollout.sglang.server import python_nccl_version
from moe_rl.rollout.types import RolloutError, SamplingParams
from moe_rl.rollout.weight_sync import distributed, nccl
from moe_rl.rollout.weight_sync.distributed import DistributedSync
from moe_rl.rollout.weight_sync.nccl import check_nccl_versions
from parallel.launch import free_port
from test_rollout import CheckpointWeights, start_server

ALL_IN_ONE_BUCKET = 64 << 20  # the tiny model in one broadcast (gloo then waits for its receivers)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "v1", "qwen3_moe", seed=12)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    started = [start_server(model, log_dir), start_server(model, log_dir)]
    yield started
    for s in started:
        s.stop()


def faults(server, **kinds) -> None:
    httpx.post(server.url + "/_test/faults", json=kinds, timeout=10).raise_for_status()


def sync_to(servers, **kwargs) -> DistributedSync:
    engine = SGLangEngine([s.url for s in servers], num_layers=2, top_k=2)
    return DistributedSync(engine, dtype=torch.float32, backend="gloo", **kwargs)


def serves_after_the_failure(servers, sync: DistributedSync, model: str) -> None:
    """No server is left paused or in a session, and the same sync pushes again (a new group)."""
    for server in servers:
        for path in ("/begin_weight_update", "/end_weight_update"):
            assert httpx.post(server.url + path, json={}, timeout=10).json()["success"], path
    assert sync.link is None  # the failed group was aborted and forgotten
    sync.push(CheckpointWeights(model), "again")
    groups = sync.engine.generate([[3, 17, 22]], 1, SamplingParams(max_new_tokens=2), seed=1)
    assert groups[0][0].weight_version == "again"


def test_a_refused_bucket_stops_the_push_at_once_with_the_servers_message(servers, model) -> None:
    """Server 0 answers HTTP 400 to a flattened bucket while server 1 waits in the broadcast:
    the push stops within seconds (the group's timeout is 60 s) naming server 0 and its
    message, and the servers serve on."""
    faults(servers[0], refuse_buckets=1)
    sync = sync_to(servers, bucket_bytes=ALL_IN_ONE_BUCKET, timeout_s=60)
    start = time.monotonic()
    try:
        with pytest.raises(
            RolloutError,
            match=re.escape(f"{servers[0].url}/update_weights_from_distributed failed (HTTP 400): ")
            + "injected refusal of load_format=flattened_bucket",
        ):
            sync.push(CheckpointWeights(model), "1")
        assert time.monotonic() - start < 15
        serves_after_the_failure(servers, sync, model)
    finally:
        sync.close()


@pytest.mark.parametrize("stall", ["stall_weight_groups", "stall_buckets"])
def test_a_server_that_never_joins_or_receives_stops_the_push_within_the_bound(servers, model, stall) -> None:
    """Server 0 neither joins the group nor receives the bucket for 20 s: the push stops
    after the group's timeout (2 s here), naming what timed out."""
    faults(servers[0], **{stall: 1, "stall_s": 20})
    sync = sync_to(servers, bucket_bytes=ALL_IN_ONE_BUCKET, timeout_s=2)
    what = "joining weight-update group" if stall == "stall_weight_groups" else "broadcasting a bucket"
    start = time.monotonic()
    try:
        with pytest.raises(RolloutError, match=f"{what} .*failed: .*"):
            sync.push(CheckpointWeights(model), "1")
        assert time.monotonic() - start < 15
    finally:
        faults(servers[0])
        sync.close()


def test_nccl_versions_are_compared_before_a_group_is_joined(monkeypatch, model, caplog) -> None:
    check_nccl_versions("2.27.7", {"http://a:1": "2.27.7"})
    with pytest.raises(RolloutError) as refused:
        check_nccl_versions("2.27.7", {"http://a:1": "2.27.7", "http://b:2": "2.21.5"})
    line = str(refused.value)
    assert "\n" not in line and "NCCL 2.27.7" in line and "http://b:2 NCCL 2.21.5" in line
    assert "tools/setup.sh --sglang" in line and "rollout.weight_sync.method=disk" in line
    with caplog.at_level(logging.WARNING, logger=nccl.__name__):
        check_nccl_versions("2.27.7", {"http://attached:1": None})
    assert "cannot check the NCCL version of SGLang server(s) ['http://attached:1']" in caplog.text

    # through the sync: a launched server's probe answers, the trainer's NCCL stands in on CPU
    monkeypatch.setattr(distributed, "trainer_nccl_version", lambda: "2.27.7")
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]  # never asked: nobody listens
    engine = SGLangEngine(urls, nccl_version_probes=[lambda: "2.27.7", lambda: "2.21.5"])
    sync = DistributedSync(engine, bucket_bytes=1 << 20, dtype=torch.float32, backend="nccl")
    with pytest.raises(RolloutError, match=re.escape(f"{urls[1]} NCCL 2.21.5")):
        sync.push(CheckpointWeights(model), "1")
    assert sync.link is None


def test_a_servers_python_is_asked_its_nccl_version(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 2.21.5\n")
    fake.chmod(0o755)
    assert python_nccl_version(str(fake)) == "2.21.5"
    assert python_nccl_version(str(tmp_path / "missing")) is None
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 2.21.5; exit 1\n")
    failing.chmod(0o755)
    assert python_nccl_version(str(failing)) is None


def test_an_attached_url_nobody_listens_on_is_reported_at_once(caplog) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start = time.time()  # (log records carry the wall clock)
    with caplog.at_level(logging.WARNING, logger="moe_rl.rollout.sglang"):
        with pytest.raises(RolloutError, match=re.escape(f"['{url}'] not healthy after 2s") + ".*ConnectError"):
            SGLangEngine([url]).wait_healthy(timeout_s=2, poll_s=0.2)
    (warning,) = [r for r in caplog.records if "waiting up to 2s for SGLang server(s)" in r.getMessage()]
    assert url in warning.getMessage() and "ConnectError" in warning.getMessage()
    assert warning.created - start < 1.5, "reported at the first refusal, not at the bound"


@pytest.mark.e2e
def test_a_run_whose_server_refuses_a_bucket_stops_with_its_message(demo_cache, stand_in_sglang, tmp_path) -> None:
    """``moe-rl train`` against a server that refuses the first bucket of its first sync:
    exit 3, one line naming the server and its message, the group timeout never waited."""
    from conftest import WARM_START, demo_weights_on, moe_rl

    url = demo_weights_on(stand_in_sglang, demo_cache)
    before = httpx.get(url + "/_test/stats", timeout=10).json()["weight_groups"]
    faults(stand_in_sglang, refuse_buckets=1)
    try:
        out = moe_rl(
            "train",
            *WARM_START,
            f"warm_start.cache_dir={demo_cache}",
            f"train.run_dir={tmp_path / 'run'}",
            "train.progress=false",
            "rollout.engine=sglang",
            f"rollout.server.urls=[{url}]",
            timeout=300,
        )
    finally:
        faults(stand_in_sglang)
        for name in set(httpx.get(url + "/_test/stats", timeout=10).json()["weight_groups"]) - set(before):
            httpx.post(url + "/destroy_weights_update_group", json={"group_name": name}, timeout=10)
    assert out.returncode == 3, out.stderr[-3000:]
    stopped = [line for line in out.stderr.splitlines() if line.startswith("moe-rl: ")]
    assert stopped == [
        f"moe-rl: stopped: {url}/update_weights_from_distributed failed (HTTP 400): "
        "injected refusal of load_format=flattened_bucket"
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_a_sender_on_another_host_advertises_the_address_towards_the_first_ranks_host(monkeypatch) -> None:
    """Loopback server URLs name the first rank's host: a later stage's sender on another
    node advertises its interface towards that host (MASTER_ADDR), never loopback, which
    would send the servers to themselves; without a routable MASTER_ADDR it says so."""
    import ipaddress

    local = ["http://127.0.0.1:30000", "http://localhost:30001"]
    assert distributed.reachable_address(local) == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # (TEST-NET-1: routed, never reached)
    monkeypatch.setenv("MASTER_PORT", "29500")
    elsewhere = distributed.reachable_address(local, on_first_host=False)
    assert not ipaddress.ip_address(elsewhere).is_loopback
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RolloutError, match="give rollout.server.urls with the host's name"):
        distributed.reachable_address(local, on_first_host=False)
