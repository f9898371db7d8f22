"""megatron-core backend on CPU: parity with transformers, HF round trip, and every
parallel layout (TP, EP, PP, ETP, PP x EP) against the single-process run; the other
MoE families (Qwen3-MoE renormalised, Mixtral, Qwen2-MoE, OLMoE, GLM-4.5, DeepSeek-V3
with MLA) against transformers on the main layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import SUPPORT
from moe_rl.models.hf_weights import SafetensorsDir
from moe_rl.models.tiny import save_tiny_checkpoint
from parallel.launch import spawn_local


WORKER = str(SUPPORT / "dist_worker.py")
ALL_LAYOUTS = {
    1: ["1,1,1,1"],
    2: ["2,1,1,2", "2,1,1,1", "1,1,2,1", "1,2,1,1"],  # TP2+SP, TP2/ETP1, EP2, PP2
    4: ["1,2,2,1", "2,1,2,1", "2,1,2,2"],  # PP2 x EP2, TP2 x EP2 with ETP1 and ETP2
}
FAMILIES = {  # name: (model_type, config overrides); qwen3 (norm_topk_prob=False) is the main model above
    "qwen3_norm": ("qwen3_moe", {"norm_topk_prob": True}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "olmoe": ("olmoe", {}),
    "glm4_moe": ("glm4_moe", {}),
    # multi-head latent attention with DeepSeek-V3's YaRN settings (mscale = mscale_all_dim)
    "deepseek_v3": (
        "deepseek_v3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            }
        },
    ),
    # Kimi-K2 (DeepSeek-V3's layout under model_type kimi_k2): 3 layers, a dense one and 2 MoE, which PP2 splits 2 + 1
    "kimi_k2": ("kimi_k2", {}),
}
FAMILY_LAYOUTS = ["1,1,1,1", "2,1,1,2", "1,1,2,1", "1,2,1,1", "2,1,2,1"]  # 1 process, TP2, EP2, PP2, TP2 x EP2 ETP1


@pytest.fixture(scope="module")
def qwen3_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3")
    # 97 tokens: under TP2 the vocabulary is padded to 98 rows, which must never be scored
    hf_dir = save_tiny_checkpoint(root / "hf", "qwen3_moe", seed=1, vocab_size=97)
    families = [
        save_tiny_checkpoint(root / "families" / f, t, seed=2, vocab_size=97, **kw) for f, (t, kw) in FAMILIES.items()
    ]
    for nproc, layouts in ALL_LAYOUTS.items():
        family_args = [a for f in families for a in ("--family", f)] + ["--family-layouts", *FAMILY_LAYOUTS]
        checkpoints = ["--checkpoints", str(root / "checkpoints")]  # (the 1- and 2-process runs: checkpoint_checks)
        code = spawn_local(
            nproc,
            ["-W", "ignore", WORKER, hf_dir, str(root / "out"), *layouts, *family_args, *checkpoints],
            timeout_s=500,
        )
        assert code == 0, f"{nproc}-process worker failed with exit code {code}"
    return root / "out"


@pytest.fixture(scope="module")
def family_references(qwen3_runs: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """transformers' log-probs and entropies of the worker's batch, per family."""
    from dist_worker import fixed_batch

    from moe_rl.commands.parity import transformers_logprobs

    refs = {}
    for family in FAMILIES:
        hf_dir = qwen3_runs.parent / "families" / family
        ids = torch.cat([mb.input_ids for mb in fixed_batch(97)])
        refs[family] = transformers_logprobs(str(hf_dir), ids)
    return refs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", FAMILY_LAYOUTS)
def test_family_matches_transformers_and_replays_exactly(
    qwen3_runs: Path, family_references, family: str, layout: str
) -> None:
    run = qwen3_runs / layout.replace(",", "-") / family
    logp, entropy = family_references[family]
    torch.testing.assert_close(torch.load(run / "logp.pt"), logp, rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.load(run / "entropy.pt"), entropy, rtol=0, atol=1e-4)
    results = _replay_results(run)
    assert results, "no replay results"
    for r in results:
        assert r["replay_identical"], "R2 replay before any update must reproduce the old log-probs bit for bit"
        assert r["r3_maxdiff"] <= 2e-5, "R3 replay of transformers' routing must reproduce megatron's log-probs"
        if family == "glm4_moe" and layout in (
            "1,1,1,1",
            "1,1,2,1",
        ):  # the expert-bias rule (tests/support/dist_worker.py BIAS_CHECKS)
            assert r["nan_update_skipped"] and r["bias_kept_on_skip"], (
                "a skipped update must not move the expert biases"
            )
            assert r["bias_moved_by_rate"], "an update moves each expert bias by the rate (or not at all)"
            assert r["expert_load_counts_only_real_tokens"], "padding must not count towards the expert-bias load"
            assert r["bf16_export_keeps_fp32_biases"] in (True, None) and r["bf16_sync_keeps_fp32_biases"] in (
                True,
                None,
            )
    if family == "glm4_moe" and layout in ("1,1,1,1", "1,1,2,1"):  # rank 0 writes and receives the biases
        assert results[0]["bf16_export_keeps_fp32_biases"] and results[0]["bf16_sync_keeps_fp32_biases"], (
            "bf16 exports and syncs must keep the expert biases in fp32"
        )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", FAMILY_LAYOUTS)
def test_family_export_round_trip_is_exact(qwen3_runs: Path, family: str, layout: str) -> None:
    """Loaded under the layout and exported: every tensor (expert biases included) back bit for bit."""
    a, b = (
        SafetensorsDir(qwen3_runs.parent / "families" / family),
        SafetensorsDir(qwen3_runs / layout.replace(",", "-") / family / "export"),
    )
    assert a.keys() == b.keys()
    for key in sorted(a.keys()):
        assert torch.equal(a.get(key), b.get(key)), key
    assert any("e_score_correction_bias" in k for k in a.keys()) == (family in ("glm4_moe", "deepseek_v3", "kimi_k2"))


def test_uneven_pipeline_stages_equal_one_process(qwen3_runs: Path) -> None:
    """Kimi-K2's 3 layers (dense, MoE, MoE) on 2 pipeline stages, 2 + 1: the loss and every
    gradient equal the one-process run's (log-probs and the export: the family tests)."""
    ref, run = qwen3_runs / "1-1-1-1" / "kimi_k2", qwen3_runs / "1-2-1-1" / "kimi_k2"
    stage_layers = [
        {int(k.split(".")[2]) for k in torch.load(f) if k.startswith("model.layers.")}
        for f in sorted(run.glob("grads_rank*.pt"))
    ]
    assert stage_layers == [{0, 1}, {2}], (
        "stage 0 holds the dense layer and the first MoE layer, stage 1 the last layer"
    )
    torch.testing.assert_close(torch.load(run / "loss.pt"), torch.load(ref / "loss.pt"), rtol=1e-6, atol=1e-6)
    ref_grads, grads = _grads(ref), _grads(run)
    assert set(grads) == set(ref_grads) and any(".experts." in k for k in grads)
    for key, g in ref_grads.items():
        torch.testing.assert_close(grads[key], g, rtol=1e-4, atol=2e-6, msg=lambda m: f"{key}: {m}")
        assert g.abs().sum() > 0 or ".experts." in key, f"{key}: no gradient"


def _grads(run: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for file in sorted(run.glob("grads_rank*.pt")):
        part = torch.load(file)
        assert not set(part) & set(merged), "two ranks wrote the same tensor"
        merged.update(part)
    return merged


@pytest.mark.parametrize("layout", [l for n in (2, 4) for l in ALL_LAYOUTS[n]])
def test_layout_matches_single_process(qwen3_runs: Path, layout: str) -> None:
    ref, run = qwen3_runs / "1-1-1-1", qwen3_runs / layout.replace(",", "-")
    torch.testing.assert_close(torch.load(run / "logp.pt"), torch.load(ref / "logp.pt"), rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.load(run / "entropy.pt"), torch.load(ref / "entropy.pt"), rtol=0, atol=2e-5)
    ref_grads, grads = _grads(ref), _grads(run)
    assert set(grads) == set(ref_grads)
    for key, g in ref_grads.items():
        torch.testing.assert_close(grads[key], g, rtol=1e-4, atol=2e-6, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(torch.load(run / "losses.pt"), torch.load(ref / "losses.pt"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sharding", ["dpr", "full"])
def test_optimizer_checkpoint_resumes_under_another_data_parallel_size(qwen3_runs: Path, sharding: str) -> None:
    """A distributed optimizer's checkpoint written in one process (DP 1), ``dp_reshardable``
    (train.checkpoint_reshardable=false: each rank's own shard, no gather) or
    ``fully_reshardable``, loaded on two (DP 2): the step after it (Adam's moments and step
    count from the checkpoint, the batch split over the DP ranks) gives the one-process
    run's weights."""
    ref, got = torch.load(qwen3_runs / "ckpt_reference.pt"), torch.load(qwen3_runs / f"ckpt_{sharding}_dp2.pt")
    assert set(got) == set(ref) and any(".experts." in k for k in ref)
    for key, w in ref.items():
        torch.testing.assert_close(got[key], w, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("run", ["dp2", "ep2dp4", "tp2dp2", "tp2ep2dp2"])
def test_fully_parallel_load_gives_each_rank_the_state_its_own_reads_give(qwen3_runs: Path, run: str) -> None:
    """load_checkpoint's default, megatron's fully parallel load over the data-parallel ranks
    (each shared tensor read by one rank and broadcast), against each rank reading all it
    needs itself: every rank's weights and optimizer state bit-equal, for the one-process
    checkpoints loaded on DP 2 (dp_reshardable and fully_reshardable) and resharded to
    EP 2 x DP 4 (expert DP 2), TP 2 x DP 2 (expert TP 2 x expert DP 2: the experts'
    gate and up halves, strided views, exchanged) and TP 2 x EP 2 x DP 2 (fully_reshardable)."""
    import json

    ranks = json.loads((qwen3_runs / f"ckpt_parallel_load_{run}.json").read_text())
    assert len(ranks) == (2 if run == "dp2" else 4)
    for per_rank in ranks:
        for name, r in per_rank.items():
            assert r["parallel_vs_serial"] == [], (name, r["parallel_vs_serial"][:5])
            assert r["unloaded_vs_serial"] > 0 and r["tensors"] > 0  # the load did change the state


def test_dp_reshardable_checkpoint_refuses_another_layout_in_one_line(qwen3_runs: Path) -> None:
    message = (qwen3_runs / "ckpt_dpr_ep2_refusal.txt").read_text()
    assert "\n" not in message and "train.checkpoint_reshardable=false" in message, message
    assert "under tp=1 pp=1 ep=1 etp=1" in message and "not tp=1 pp=1 ep=2 etp=1" in message, message


@pytest.mark.parametrize("layout", ["1,1,1,1", "1,1,2,1"])
def test_colocated_tensor_sync_sends_each_tp_rank_a_payload_from_its_own_gpus_rank(
    qwen3_runs: Path, layout: str
) -> None:
    """``/update_weights_from_tensor`` to a server of TP 2 whose ranks run on GPUs "1" and "0"
    (tests/support/dist_worker.py tensor_sync_checks): every body holds 2 entries; on two trainer
    ranks (GPUs "0", "1") entry 0 maps rank 1's copy and entry 1 rank 0's, in one process
    both its own; every entry maps the full HF weights, as the one-process run's and the
    checkpoint's."""
    import json

    run = qwen3_runs / layout.replace(",", "-")
    summary = json.loads((run / "tensor_sync.json").read_text())
    pids = summary["rank_pids"]
    expected = [[pids[1]], [pids[0]]] if len(pids) == 2 else [[pids[0]], [pids[0]]]
    assert summary["producers"] == ([[1, 0]] if len(pids) == 2 else [[0, 0]])
    assert len(summary["bodies"]) > 1  # several buckets
    for body in summary["bodies"]:
        assert body["path"] == "/update_weights_from_tensor" and body["entries"] == 2
        assert body["pids"] == expected
    got, ref = torch.load(run / "tensor_sync.pt"), torch.load(qwen3_runs / "1-1-1-1" / "tensor_sync.pt")
    hf = SafetensorsDir(qwen3_runs.parent / "hf")
    assert set(got) == set(ref) == set(hf.keys())
    for name, entries in got.items():
        assert entries.shape[0] == 2 and torch.equal(entries, ref[name]), name
        assert torch.equal(entries[0], hf.get(name).to(entries.dtype)) and torch.equal(entries[1], entries[0]), name


def test_loss_goes_down_over_optimizer_steps(qwen3_runs: Path) -> None:
    for layout in ("1-1-1-1", "1-1-2-1", "1-2-1-1", "1-2-2-1"):
        losses = torch.load(qwen3_runs / layout / "losses.pt")
        assert (losses[1:] < losses[:-1]).all(), f"{layout}: {losses.tolist()}"


def _replay_results(run: Path) -> list[dict]:
    import json

    return [json.loads(p.read_text()) for p in sorted(run.glob("replay_rank*.json"))]


@pytest.mark.parametrize("layout", [l for n in (1, 2, 4) for l in ALL_LAYOUTS[n]])
def test_routing_replay_on_every_layout(qwen3_runs: Path, layout: str) -> None:
    results = _replay_results(qwen3_runs / layout.replace(",", "-"))
    assert results, "no replay results"
    for r in results:
        assert r["replay_identical"], "replay before any update must reproduce the old log-probs exactly"
        assert r["used_equals_recorded"], "the replayed pass must dispatch to the recorded experts"
        assert r["sampled_probe_in_recompute"], "a probe's sampled tokens must be its forward's, recompute or not"
        assert r["router_grad_min"] is None or r["router_grad_min"] > 0, "the router must keep a gradient"
        assert r["r3_maxdiff"] <= 2e-5, "R3 with the model's own routing must reproduce its log-probs"
    assert sum(r["natural_changed_tokens"] for r in results) > 0, "the router change must change routing"


@pytest.mark.parametrize("layout", [l for n in (2, 4) for l in ALL_LAYOUTS[n]])
def test_reduced_drift_matches_single_process(qwen3_runs: Path, layout: str) -> None:
    ref = _replay_results(qwen3_runs / "1-1-1-1")[0]["drift"]
    for r in _replay_results(qwen3_runs / layout.replace(",", "-")):
        got = r["drift"]
        assert got["drift_layers"] == ref["drift_layers"] and got["load_layers"] == ref["load_layers"]
        tokens = 4 * 12  # one flipped near-tie token is tolerated
        for key in ("changed_frac", "expert_change_frac", "any_layer_changed_frac", "expert_load_cv"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=0, atol=1.0 / tokens + 1e-9)
        torch.testing.assert_close(torch.tensor(got["router_kl"]), torch.tensor(ref["router_kl"]), rtol=1e-3, atol=1e-6)
        assert 0 < ref["changed_frac"][0] < 1


def test_multi_token_prediction_layers_are_the_only_keys_skipped() -> None:
    from moe_rl.models.hf_weights import multi_token_prediction_keys
    from moe_rl.models.tiny import tiny_config

    keys = {
        "model.layers.3.mlp.gate.weight",
        "model.layers.4.eh_proj.weight",
        "model.layers.40.mlp.gate.weight",
        "lm_head.weight",
    }
    assert multi_token_prediction_keys(keys, tiny_config("glm4_moe", num_nextn_predict_layers=1)) == {
        "model.layers.4.eh_proj.weight"
    }
    assert multi_token_prediction_keys(keys, tiny_config("glm4_moe", num_nextn_predict_layers=0)) == set()
