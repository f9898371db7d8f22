"""Routing pieces that need no model: SGLang encoding, engine routing -> replay indices,
the rank-reduced stats (one process), TensorBoard tags, and the drift command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import moe_rl_in_process
from moe_rl.routing.drift import drift_metrics, load_metrics
from moe_rl.routing.encoding import (
    decode_routed_experts,
    encode_routed_experts,
    expert_index_dtype,
    load_routing,
    repeats_an_expert,
    save_routing,
)
from moe_rl.routing.monitor import sampled_tokens
from moe_rl.routing.replay import ReplayError, RoutingReplay, engine_routing_to_replay, to_local_tokens
from moe_rl.routing.stats import RoutingStats


def test_sglang_encoding_round_trip_and_layout() -> None:
    idx = torch.randint(0, 8, (5, 3, 2), dtype=torch.int32)
    text = encode_routed_experts(idx)
    assert torch.equal(decode_routed_experts(text, num_layers=3, top_k=2), idx)
    # raw little-endian int32, row-major [tokens, layers, k]
    import base64
    import struct

    raw = base64.b64decode(text)
    assert struct.unpack("<i", raw[4:8])[0] == idx[0, 0, 1].item()
    with pytest.raises(ValueError, match="multiple of num_layers"):
        decode_routed_experts(text, num_layers=4, top_k=2)


@pytest.mark.parametrize(
    "num_experts, dtype",
    [(8, torch.uint8), (256, torch.uint8), (257, torch.int16), (32768, torch.int16), (32769, torch.int32)],
)
def test_routing_is_kept_in_the_smallest_type_and_decodes_as_sglangs_int32(
    num_experts: int, dtype: torch.dtype
) -> None:
    import base64

    import numpy as np

    from moe_rl.rollout.sglang.engine import SGLangEngine

    assert expert_index_dtype(num_experts) == dtype
    gen = torch.Generator().manual_seed(num_experts)
    # edge ids: 255 and 256 where they exist
    top = [0, num_experts - 1, min(255, num_experts - 1), min(256, num_experts - 1)]
    # 4 distinct per token
    idx = torch.randint(0, num_experts - 3, (30, 3, 1), generator=gen) + torch.randperm(4, generator=gen)
    idx[0, 0] = torch.tensor(sorted(set(top)) + [e for e in range(1, 4) if e not in top][: 4 - len(set(top))])
    text = base64.b64encode(idx.to(torch.int32).numpy().astype("<i4").tobytes()).decode()
    engine = SGLangEngine(["http://127.0.0.1:1"], num_layers=3, top_k=4, num_experts=num_experts)
    got = engine._decode_routing(text, positions=30)
    # SGLang's own layout
    reference = torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<i4").reshape(30, 3, 4).copy())
    assert got.dtype == dtype and torch.equal(got.to(torch.int32), reference)
    with pytest.raises(ValueError, match="outside"):
        decode_routed_experts(text, 3, 4, num_experts=int(idx.max()))
    with pytest.raises(ValueError, match="covers 30 positions"):
        engine._decode_routing(text, positions=29)
    repeated = idx.clone()
    repeated[29, 2, 3] = repeated[29, 2, 0]  # the last pair of the last token
    assert not repeats_an_expert(idx) and repeats_an_expert(repeated)
    with pytest.raises(ValueError, match="repeats an expert"):
        engine._decode_routing(encode_routed_experts(repeated), positions=30)
    replay = engine_routing_to_replay([got], seq_len=32, layer_numbers=[0, 2], top_k=4, num_experts=num_experts)
    wide = engine_routing_to_replay(
        [reference.long()], seq_len=32, layer_numbers=[0, 2], top_k=4, num_experts=num_experts
    )
    assert replay[0].dtype == dtype and all(torch.equal(a.long(), b.long()) for a, b in zip(replay, wide))


def test_replay_refuses_megatrons_fused_router() -> None:
    """Transformer Engine's fused top-k never calls RouterReplay: replay on it would silently
    route afresh, so it is refused by name."""
    from types import SimpleNamespace as NS

    router = NS(router_replay=object(), config=NS(moe_router_fusion=True, num_moe_experts=8), topk=2)
    model = NS(decoder=NS(layers=[NS(layer_number=1, mlp=NS(router=router))]))
    with pytest.raises(ValueError, match="moe_router_fusion=True"):
        RoutingReplay(model)
    router.config.moe_router_fusion = False
    assert len(RoutingReplay(model).instances) == 1


def test_metrics_sample_the_stated_share_of_tokens_deterministically() -> None:
    mask = (torch.arange(150) % 3 != 0).float()  # 100 tokens count
    picked = sampled_tokens(mask, 0.25, seed=7)
    assert len(picked) == 25 and bool((mask[picked] > 0).all()) and torch.equal(picked, picked.sort().values.unique())
    assert torch.equal(picked, sampled_tokens(mask, 0.25, seed=7)) and not torch.equal(
        picked, sampled_tokens(mask, 0.25, seed=8)
    )
    assert len(sampled_tokens(mask, 0.001, seed=7)) == 1 and torch.equal(
        sampled_tokens(mask, 1.0, seed=7), mask.nonzero().flatten()
    )


def test_engine_routing_to_replay_order_fill_layers_and_sp_slice() -> None:
    k = 2
    seq_a = torch.tensor([[[1, 2], [3, 4], [5, 6]], [[7, 0], [1, 3], [2, 4]]])  # 2 positions
    seq_b = torch.tensor([[[6, 5], [4, 3], [2, 1]]])  # 1 position
    out = engine_routing_to_replay([seq_a, seq_b], seq_len=4, layer_numbers=[0, 2], top_k=k, num_experts=8)
    assert len(out) == 2 and out[0].shape == (8, 2)
    # megatron order: token (t, j) at t * b + j; a position t without engine routing gets
    # experts 2t, 2t+1 (mod 8): padding spreads over the experts instead of piling on 0 and 1
    expected_l0 = torch.tensor([[1, 2], [6, 5], [7, 0], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]])
    assert torch.equal(out[0], expected_l0)
    assert torch.equal(out[1][0], torch.tensor([5, 6])) and torch.equal(out[1][2], torch.tensor([2, 4]))
    sp = engine_routing_to_replay(
        [seq_a, seq_b], 4, [0, 2], k, num_experts=8, tp_rank=1, tp_size=2, sequence_parallel=True
    )
    assert torch.equal(sp[0], expected_l0[4:])
    long_pad = engine_routing_to_replay([seq_b], seq_len=33, layer_numbers=[0], top_k=2, num_experts=8)[0][1:]
    assert torch.equal(torch.bincount(long_pad.flatten(), minlength=8), torch.full((8,), 8))  # every expert alike
    with pytest.raises(ReplayError, match="top_k"):
        engine_routing_to_replay([seq_a], 4, [0], top_k=3, num_experts=8)
    with pytest.raises(ReplayError, match="covers 3 layers"):
        engine_routing_to_replay([seq_a], 4, [5], top_k=2, num_experts=8)
    with pytest.raises(ReplayError, match="divisible by tp"):
        to_local_tokens(torch.zeros(1, 5), tp_size=2, sequence_parallel=True)


def test_samples_and_stages_without_engine_routing() -> None:
    """A sample the engine returned no routing for (an empty response) gets the filler every
    unrouted position gets, the others theirs; a pipeline stage without MoE layers (DeepSeek-V3's
    dense first layers on a stage of their own) has nothing to replay instead of failing on
    top_k 0 while the other stages wait in their pipeline receives."""
    from types import SimpleNamespace

    from moe_rl.routing.step_replay import engine_indices
    from moe_rl.trainer.old_policy import _engine_routing

    seq_a = torch.tensor([[[1, 2], [3, 4], [5, 6]], [[7, 0], [1, 3], [2, 4]]])
    both = engine_routing_to_replay([seq_a, torch.zeros(0, 3, 2, dtype=seq_a.dtype)], 4, [0, 2], 2, num_experts=8)
    with_none = engine_routing_to_replay([seq_a, None], 4, [0, 2], 2, num_experts=8, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(both, with_none))
    batches = [SimpleNamespace(routed_experts=[seq_a, None], input_ids=torch.zeros(2, 4, dtype=torch.long))]
    assert _engine_routing(batches) == [[seq_a, None]]
    dense_stage = torch.nn.Module()
    dense_stage.decoder = SimpleNamespace(layers=[SimpleNamespace(mlp=torch.nn.Linear(2, 2), layer_number=1)])
    assert engine_indices(dense_stage, batches, _engine_routing(batches), num_experts=8) == [[]]
    with pytest.raises(ValueError, match="no routed experts"):
        _engine_routing([SimpleNamespace(routed_experts=None)])


def test_stats_in_one_process_equal_the_plain_metrics() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(40 * 3)]).view(40, 3, 2)
    b = a.clone()
    b[::3, 1] = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(14)])
    pa = torch.softmax(torch.randn(40, 3, 6, generator=gen), -1)
    pb = torch.softmax(torch.randn(40, 3, 6, generator=gen), -1)
    mask = (torch.arange(40) % 5 != 0).float()
    stats = RoutingStats(num_layers=5, num_experts=6)
    layers = [0, 2, 4]
    for part in (slice(0, 17), slice(17, 40)):  # two micro-batches
        stats.add_drift(layers, a[part], b[part], mask[part], pa[part], pb[part])
        stats.add_load(layers, a[part], mask[part])
    got = stats.reduce()
    ref = {**drift_metrics(a, b, probs_a=pa, probs_b=pb, mask=mask), **load_metrics(a, 6, mask)}
    assert got["drift_layers"].tolist() == layers and got["load_layers"].tolist() == layers
    for key in (
        "changed_frac",
        "expert_change_frac",
        "any_layer_changed_frac",
        "router_kl",
        "expert_load",
        "expert_load_cv",
        "expert_load_entropy",
    ):
        torch.testing.assert_close(got[key].double(), ref[key].double(), msg=key)
    # expert disagreement: per layer and expert, the tokens whose two top-k sets hold it once
    onehot = lambda x: torch.zeros(40, 3, 6).scatter_(-1, x, 1.0)  # noqa: E731
    one_sided = (onehot(a) != onehot(b)).double() * mask.double()[:, None, None]
    torch.testing.assert_close(got["expert_disagreement"], one_sided.sum(0) / mask.sum())


def test_stats_split_token_values_by_routing_change() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(30 * 2)]).view(30, 2, 2)
    b = a.clone()
    b[::4, 0] = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(8)])
    mismatch, response = torch.rand(30, generator=gen), (torch.arange(30) % 3 != 0).double()
    stats = RoutingStats(num_layers=2, num_experts=6)
    for part in (slice(0, 11), slice(11, 30)):
        stats.add_drift([0, 1], a[part], b[part], torch.ones(30)[part])
    clipped = (torch.arange(30) % 2).double()
    stats.add_token_values(
        ("logp_mismatch", "clip_frac"),
        [torch.stack([mismatch[p], clipped[p], response[p]]) for p in (slice(0, 11), slice(11, 30))],
    )
    got = stats.reduce(replicas=2)
    changed = (torch.sort(a, -1).values != torch.sort(b, -1).values).any(-1).any(-1).double()
    assert 0 < changed.sum() < 30
    expect = {
        "logp_mismatch": (mismatch * response).sum() / response.sum(),
        "logp_mismatch_routing_changed": (mismatch * response * changed).sum() / (response * changed).sum(),
        "logp_mismatch_routing_same": (mismatch * response * (1 - changed)).sum() / (response * (1 - changed)).sum(),
        "routing_changed_response_frac": (response * changed).sum() / response.sum(),
        "clip_frac_routing_changed": (clipped * response * changed).sum() / (response * changed).sum(),
        "routing_changed_tokens": (response * changed).sum() / 2,  # two replicas held every token
        "routing_same_tokens": (response * (1 - changed)).sum() / 2,
    }
    for key, value in expect.items():
        assert float(got[key]) == pytest.approx(float(value)), key
    stats.add_drift([0, 1], a, b, torch.ones(30))  # a later pass: values for its routings only
    with pytest.raises(ValueError, match="2 token values for 1 routings"):
        stats.add_token_values(("logp_mismatch", "clip_frac"), [None, None])
    with pytest.raises(ValueError, match="one kind per statistics"):
        stats.add_token_values(("other",), [None])


def test_tensorboard_tags(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from moe_rl.routing.tensorboard import log_routing

    a = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    b = torch.tensor([[[0, 2], [2, 3]], [[1, 2], [0, 3]]])
    metrics = {
        **drift_metrics(a, b),
        **load_metrics(a, 4),
        "drift_layers": torch.tensor([1, 3]),
        "load_layers": torch.tensor([1, 3]),
    }
    with SummaryWriter(str(tmp_path)) as writer:
        written = log_routing(writer, 7, metrics)
        split = {"logp_mismatch_routing_changed": torch.tensor(0.25), "expert_disagreement": torch.ones(2, 4) / 4}
        log_routing(
            writer, 7, {**drift_metrics(a, b), **split, "drift_layers": torch.tensor([1, 3])}, group="train_vs_rollout"
        )
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "histograms": 0}).Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in (
        "routing/changed_frac/layer_1",
        "routing/changed_frac/layer_3",
        "routing/changed_frac/mean",
        "routing/expert_change_frac/mean",
        "routing/any_layer_changed_frac/mean",
        "routing/expert_load_cv/layer_3",
        "routing/expert_load_entropy/mean",
        "routing/train_vs_rollout/changed_frac/layer_3",
        "routing/train_vs_rollout/logp_mismatch_routing_changed/mean",
    ):
        assert tag in scalars, tag
    assert events.Scalars("routing/changed_frac/layer_1")[0].value == pytest.approx(0.5)
    assert events.Scalars("routing/changed_frac/layer_1")[0].step == 7
    assert written["routing/expert_change_frac/layer_1"] == pytest.approx(0.25)
    assert {"routing/expert_load/layer_1", "routing/expert_load/layer_3"} <= set(events.Tags()["histograms"])
    assert {"routing/expert_load_heatmap", "routing/train_vs_rollout/expert_disagreement_heatmap"} <= set(
        events.Tags()["images"]
    )


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    from safetensors.torch import save_file

    from moe_rl.models.hf_weights import SafetensorsDir
    from moe_rl.models.tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("drift")
    a = save_tiny_checkpoint(root / "a", "qwen3_moe", seed=5)
    b = save_tiny_checkpoint(root / "b", "qwen3_moe", seed=5)
    reader = SafetensorsDir(b)
    tensors = {k: reader.get(k) for k in reader.keys()}
    gen = torch.Generator().manual_seed(0)
    changed = [k for k in tensors if k.endswith("mlp.gate.weight")]  # only the routers differ
    for k in changed:
        tensors[k] = tensors[k] + 0.05 * torch.randn(tensors[k].shape, generator=gen)
    save_file(tensors, str(Path(b) / "model.safetensors"), metadata={"format": "pt"})
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": torch.randint(0, 64, (10,), generator=gen).tolist()}) + "\n" for _ in range(4))
    )
    return a, b, str(prompts)


def test_drift_command_nonzero_for_changed_routers_zero_for_identical(two_checkpoints, tmp_path: Path) -> None:
    a, b, prompts = two_checkpoints
    out = moe_rl_in_process("drift", "--a", a, "--b", b, "--prompts", prompts, "--out", str(tmp_path / "ab"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "ab" / "drift.json").read_text())
    assert report["tokens"] == 40 and report["layers"] == [0, 1]
    assert report["metrics"]["changed_frac"]["mean"] > 0 and report["metrics"]["router_kl"]["mean"] > 0
    assert len(report["metrics"]["expert_change_frac"]["layers"]) == 2
    assert (tmp_path / "ab" / "expert_load_heatmap.png").stat().st_size > 1000
    assert list((tmp_path / "ab" / "tensorboard").glob("events.out.tfevents.*"))
    same = moe_rl_in_process("drift", "--a", a, "--b", a, "--prompts", prompts, "--out", str(tmp_path / "aa"))
    assert same.returncode == 0, same.stderr
    zero = json.loads((tmp_path / "aa" / "drift.json").read_text())["metrics"]
    assert all(v["mean"] == 0.0 for v in zero.values())


def test_drift_command_on_saved_routing_files(tmp_path: Path) -> None:
    idx = torch.randint(0, 3, (30, 2, 2))  # of 4 experts, expert 3 never chosen
    other = idx.clone()
    other[:10, 0] = (other[:10, 0] + 1) % 3
    save_routing(tmp_path / "step1.safetensors", idx, num_experts=4)
    save_routing(tmp_path / "step2.safetensors", other, num_experts=4)
    assert torch.equal(load_routing(tmp_path / "step1.safetensors")["indices"], idx.int())
    files = ["--a", str(tmp_path / "step1.safetensors"), "--b", str(tmp_path / "step2.safetensors")]
    out = moe_rl_in_process("drift", *files, "--out", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r" / "drift.json").read_text())
    assert report["metrics"]["changed_frac"]["layers"] == [pytest.approx(1 / 3), 0.0]
    load = torch.tensor(report["expert_load_a"]["expert_load"]["layers"])
    assert load.shape == (2, 4) and (load[:, 3] == 0).all()  # the unchosen expert is counted, with 0
    expected_cv = load.std(dim=1, unbiased=False) / load.mean(dim=1)
    assert report["expert_load_a"]["expert_load_cv"]["layers"] == pytest.approx(expected_cv.tolist())
    refused = moe_rl_in_process("drift", *files, "--num-experts", "3", "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "the expert counts disagree: [3, 4]" in refused.stderr
    save_routing(tmp_path / "old.safetensors", idx)  # records no count
    plain = ["--a", str(tmp_path / "old.safetensors"), "--b", str(tmp_path / "old.safetensors")]
    unknown = moe_rl_in_process("drift", *plain, "--out", str(tmp_path / "y"))
    assert unknown.returncode == 2 and "pass --num-experts" in unknown.stderr
    assert moe_rl_in_process("drift", *plain, "--num-experts", "4", "--out", str(tmp_path / "z")).returncode == 0


def test_expert_load_takes_the_compact_indices_of_256_experts() -> None:
    from moe_rl.routing.drift import expert_load
    from moe_rl.routing.encoding import expert_index_dtype

    idx = torch.tensor([[[0, 255]], [[3, 255]]], dtype=expert_index_dtype(256))  # uint8
    load = expert_load(idx, 256)
    assert load.shape == (1, 256) and load[0, 255] == 2 and load[0, 0] == 1 and load.sum() == 4
    with pytest.raises(ValueError, match="out of range"):
        expert_load(idx, 255)


def test_drift_command_errors(tmp_path: Path, two_checkpoints) -> None:
    a, _, _ = two_checkpoints
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1, 2]}\nnot json\n')
    out = moe_rl_in_process("drift", "--a", a, "--b", a, "--prompts", str(bad), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and f"{bad}:2: not valid JSON" in out.stderr and "Traceback" not in out.stderr
    missing = moe_rl_in_process("drift", "--a", a, "--b", a, "--out", str(tmp_path / "y"))
    assert missing.returncode == 2 and "--prompts is needed" in missing.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2]}\n')
    engine = [
        "--engine",
        "http://127.0.0.1:1",
        "--checkpoint",
        a,
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "z"),
    ]
    for args, message in [
        (["--a", a, *engine], "give either --a and --b"),
        (["--a", a, "--out", str(tmp_path / "z")], "--a and --b go together"),
        (
            ["--a", a, "--b", a, "--prompts", str(prompts), "--nproc", "2", "--out", str(tmp_path / "z")],
            "apply to --engine mode",
        ),
        (["--engine", "127.0.0.1:1", *engine[2:]], "needs http:// or https://"),
        ([*engine, "--samples", "0"], "--samples=0 must be >= 1"),
        ([*engine[:2], *engine[4:]], "--engine needs --checkpoint and --prompts"),
        ([*engine[:3], str(tmp_path), *engine[4:]], "not a Hugging Face model directory or a moe-rl checkpoint"),
    ]:
        out = moe_rl_in_process("drift", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_seed_table_mean_and_spread() -> None:
    from moe_rl.report import seed_table

    summary = {
        "grpo_s1": {"final": 1.0, "clip_frac": 0.1},
        "grpo_s2": {"final": 2.0, "clip_frac": 0.3},
        "gmpo_s1": {"final": 1.5},
        "gmpo_s2": {"final": 1.5},
    }
    lines = seed_table(summary, [1, 2])
    grpo = next(l for l in lines if l.startswith("| grpo |"))
    assert "1.50 ± 0.71 (1.00..2.00)" in grpo and "0.200 ± 0.14" in grpo
    gmpo = next(l for l in lines if l.startswith("| gmpo |"))
    assert "1.50 ± 0 " in gmpo and "—" in gmpo
