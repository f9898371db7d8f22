"""The trainer's parts on their own (one process, no process group): typed micro-batches,
the policy objective, weight sync, the local engine's weight precision, config types,
TensorBoard writing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.algorithms import policy_loss
from moe_rl.config import AlgorithmConfig, ConfigError, load_config
from moe_rl.rollout.types import RolloutEngine, Sample
from moe_rl.rollout.weight_sync.disk import DiskSync
from moe_rl.rollout.weight_sync.in_process import InProcessSync
from moe_rl.experience.types import Experience
from moe_rl.trainer.batch import build_train_batch
from moe_rl.trainer.packing import fixed_plan
from moe_rl.trainer.objective import UPDATE_REPORT, PolicyObjective, UpdateTokens, log_ratio_percentiles
from moe_rl.trainer.rollout_mismatch import logprob_mismatch, measure_rollout_mismatch
from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings


def sample(prompt: list[int], output: list[int], seed: int = 0) -> Sample:
    logps = [-0.1 * (i + 1) - seed for i in range(len(output))]
    routed = torch.full((len(prompt) + len(output) - 1, 2, 2), seed, dtype=torch.int32)
    return Sample(prompt, output, logps, "stop", "0", seed, routed_experts=routed)


def experience() -> Experience:
    samples = [
        sample([5, 6], [7, 8, 9], 0),
        sample([5, 6], [7], 1),
        sample([4, 4, 4], [3, 2], 2),
        sample([4, 4, 4], [], 3),
    ]
    return Experience(samples, torch.zeros(4, 1), ["r"], torch.tensor([1.0, -1.0, 0.5, -0.5]))


def test_micro_batches_place_every_token_where_its_log_prob_is() -> None:
    exp = experience()
    batch = build_train_batch(
        exp, 7, fixed_plan([0, 2, 3], 4, 2), seq_len_multiple=4, pad_id=0, device=torch.device("cpu"), with_routing=True
    )
    assert batch.step == 7 and batch.num_tokens == 6.0 and batch.num_seqs == 3.0
    # another rank has 4 samples: this one gets as many micro-batches, topped up with an empty row
    assert [mb.sample_indices for mb in batch.micro_batches] == [[0, 2], [3, -1]]
    first, second = batch.micro_batches
    # each micro-batch is padded to its own longest sample (5 and 3 tokens), rounded up to 4's multiple
    assert first.input_ids.shape == (2, 8) and second.input_ids.shape == (2, 4)
    assert first.input_ids[0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert first.lengths.tolist() == [5, 5] and second.lengths.tolist() == [3, 0]
    # position t scores token t+1: the response of sample 0 starts at position len(prompt) - 1
    assert first.mask[0].tolist() == [0, 1, 1, 1, 0, 0, 0]
    assert first.rollout_logp[0, 1:4].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert first.mask[1].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert second.input_ids[0].tolist() == [4, 4, 4, 0] and second.mask[0].tolist() == [0, 0, 0]
    assert second.mask.sum() == 0  # an empty response (and the empty row) trains nothing
    assert first.advantages.tolist() == [1.0, 0.5] and second.advantages.tolist() == [-0.5, 0.0]
    assert [r.shape[0] for r in first.routed_experts] == [4, 4]
    assert second.routed_experts[1].shape == (0, 2, 2) and (second.input_ids[1] == 0).all()
    assert first.old_logp is None and first.ref_logp is None
    without = build_train_batch(
        exp, 0, fixed_plan([0], 1, 2), seq_len_multiple=1, pad_id=0, device=torch.device("cpu"), with_routing=False
    )
    assert without.micro_batches[0].routed_experts is None and without.micro_batches[0].input_ids.shape == (1, 5)


@pytest.mark.parametrize(
    "rows, micro_batch_size, shape", [(20, 8, (3, 7)), (40, 32, (2, 20)), (16, 8, (2, 8)), (5, 32, (1, 5))]
)
def test_any_batch_splits_into_equal_micro_batches(rows: int, micro_batch_size: int, shape: tuple[int, int]) -> None:
    samples = [sample([1, 2], [3] * (1 + i % 3), i) for i in range(rows)]
    exp = Experience(samples, torch.zeros(rows, 1), ["r"], torch.linspace(-1, 1, rows))
    for indices in (list(range(rows)), list(range(rows - 1))):  # this rank's share, or one fewer
        batch = build_train_batch(
            exp,
            0,
            fixed_plan(indices, rows, micro_batch_size),
            seq_len_multiple=1,
            pad_id=0,
            device=torch.device("cpu"),
            with_routing=False,
        )
        assert (len(batch.micro_batches), batch.micro_batches[0].input_ids.shape[0]) == shape
        assert all(mb.input_ids.shape == batch.micro_batches[0].input_ids.shape for mb in batch.micro_batches)
        assert sorted(i for mb in batch.micro_batches for i in mb.sample_indices if i >= 0) == indices


@pytest.mark.parametrize(
    "loss, params", [("grpo", {}), ("gspo", {}), ("gmpo", {}), ("grpo", {"agg": "seq-mean-token-sum"})]
)
def test_micro_batch_losses_sum_to_the_full_batch_loss(loss: str, params: dict) -> None:
    """Ragged micro-batches with empty rows give exactly the loss (and gradient) of one batch."""
    rows = 7
    samples = [sample([1, 2], [3] * (1 + i % 3), i) for i in range(rows)]
    exp = Experience(samples, torch.zeros(rows, 1), ["r"], torch.linspace(-1, 2, rows))
    algo = AlgorithmConfig(loss=loss, loss_params=params)

    def total(micro_batch_size: int) -> tuple[float, torch.Tensor]:
        batch = build_train_batch(
            exp,
            0,
            fixed_plan(list(range(rows)), rows, micro_batch_size),
            seq_len_multiple=1,
            pad_id=0,
            device=torch.device("cpu"),
            with_routing=False,
        )
        objective = PolicyObjective(algo, batch.num_tokens, batch.num_seqs)
        weights = torch.zeros(rows, max(exp.lengths) - 1, requires_grad=True)
        value = 0.0
        for mb in batch.micro_batches:  # each as wide as its longest sample
            real = [i for i in mb.sample_indices if i >= 0]
            logp = torch.zeros(mb.mask.shape)
            logp[: len(real)] = weights[real, : mb.mask.shape[1]] - 0.5
            mb.old_logp = -0.45 + 0.05 * torch.arange(mb.mask.shape[1]).expand(mb.mask.shape)  # ratios vary by token
            loss, _ = objective(torch.stack([logp, torch.zeros_like(logp)], -1), mb)
            loss.backward()
            value += float(loss.detach())
        return value, weights.grad

    whole, grad_whole = total(rows)
    split, grad_split = total(3)  # 3 micro-batches of 3 rows, 2 of them empty
    assert split == pytest.approx(whole, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad_split, grad_whole)


def objective_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    exp = experience()
    batch = build_train_batch(
        exp,
        0,
        fixed_plan([0, 1, 2], 3, 3),
        seq_len_multiple=1,
        pad_id=0,
        device=torch.device("cpu"),
        with_routing=False,
    )
    mb = batch.micro_batches[0]
    logp = (-torch.rand(mb.mask.shape, generator=gen)).requires_grad_()
    entropy = torch.rand(mb.mask.shape, generator=gen)
    return batch, mb, logp, entropy


def test_objective_equals_the_policy_loss_and_reports_what_it_measured() -> None:
    batch, mb, logp, entropy = objective_inputs()
    mb.old_logp = logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    algo = AlgorithmConfig(loss="grpo", loss_params={"eps_high": 0.28})
    loss, out = PolicyObjective(algo, batch.num_tokens, batch.num_seqs)(torch.stack([logp, entropy], -1), mb)
    report = out[UPDATE_REPORT]
    metrics = report.metrics
    ref, _ = policy_loss(
        "grpo",
        logp,
        mb.old_logp,
        mb.advantages,
        mb.mask,
        eps_high=0.28,
        num_tokens=batch.num_tokens,
        num_seqs=batch.num_seqs,
    )
    torch.testing.assert_close(loss, ref)
    masked = mb.mask.bool()
    assert "log_ratio_p01" not in metrics  # selected after the pass, for all micro-batches at once
    (percentiles,), log_ratios = log_ratio_percentiles([report.tokens])
    torch.testing.assert_close(log_ratios, (logp.detach() - mb.old_logp)[masked])
    values = (logp.detach() - mb.old_logp)[masked]
    assert float(percentiles["log_ratio_p01"]) == float(torch.quantile(values, 0.01))
    assert float(percentiles["log_ratio_p99"]) == float(torch.quantile(values, 0.99))
    assert metrics["tokens"] == mb.mask.sum() and "mismatch_sum" not in metrics  # old log-probs came from a pass
    torch.testing.assert_close(metrics["entropy"], entropy[masked].mean())
    assert mb.old_logp is not None and mb.ref_logp is None  # the objective writes nothing into the batch


def test_log_ratio_percentiles_are_the_passs_whatever_the_micro_batch_split() -> None:
    """The 1st/99th percentiles of every masked log-ratio of the pass, in each micro-batch with
    tokens (none in one without), so the step's token-weighted mean gives them back: one
    micro-batch of zeros and one with an outlier report the step's p99, not the mean of
    theirs; the log-ratios come back in micro-batch order."""
    from moe_rl.algorithms.metric_spec import UPDATE_METRICS
    from moe_rl.trainer.metrics import reduce_metrics

    gen = torch.Generator().manual_seed(5)
    outputs, expected = [], []
    for rows, width, frac in ((3, 5, 0.6), (2, 7, 0.0), (4, 3, 0.8)):
        log_ratio = torch.randn(rows, width, generator=gen)
        mask = (torch.rand(rows, width, generator=gen) < frac).float()
        outputs.append(UpdateTokens(log_ratio, torch.zeros_like(mask), mask))
        expected.append(log_ratio[mask.bool()])
    percentiles, log_ratios = log_ratio_percentiles(outputs)
    everything = torch.cat(expected)
    assert log_ratios is not None and torch.equal(log_ratios, everything)
    assert "log_ratio_p01" not in percentiles[1] and "log_ratio_p99" not in percentiles[1]
    for i in (0, 2):
        assert torch.equal(percentiles[i]["log_ratio_p01"], torch.quantile(everything, 0.01))
        assert torch.equal(percentiles[i]["log_ratio_p99"], torch.quantile(everything, 0.99))
    zeros, outlier = torch.zeros(1, 100), torch.zeros(1, 100)
    outlier[0, 0] = 5.0
    split = [UpdateTokens(t, torch.zeros_like(t), torch.ones_like(t)) for t in (zeros, outlier)]
    whole = [UpdateTokens(torch.cat([zeros, outlier], 1), torch.zeros(1, 200), torch.ones(1, 200))]
    p99 = []
    for parts in (split, whole):
        per_mb, _ = log_ratio_percentiles(parts)
        rows = [{**p, "tokens": t.mask.sum()} for p, t in zip(per_mb, parts)]
        p99.append(reduce_metrics(rows, UPDATE_METRICS)["log_ratio_p99"])
    assert p99[0] == pytest.approx(p99[1], abs=1e-12)


def test_update_metrics_reduce_to_token_weighted_means_of_the_micro_batches() -> None:
    """One process: loss terms summed, the rest weighted by each micro-batch's tokens, the
    ratio's extremes over all (a float64 or a plain-number metric next to fp32 ones: the
    same figures); the off-policy sums added up before the diagnostics are formed."""
    from moe_rl.algorithms.rollout_correction import MISMATCH_SUMS, mismatch_metrics
    from moe_rl.algorithms.metric_spec import OFFPOLICY, ROLLOUT_MISMATCH_METRICS, UPDATE_METRICS, Reduction
    from moe_rl.trainer.metrics import offpolicy_scalars, reduce_metrics

    def reduce_update_metrics(outputs):
        return reduce_metrics(outputs, UPDATE_METRICS)

    def reduce_offpolicy(parts):
        return offpolicy_scalars(reduce_metrics(parts, ROLLOUT_MISMATCH_METRICS))

    SUM_METRICS = ("loss", "pg_loss")
    MEAN_METRICS = ("clip_frac", "ratio_mean", "approx_kl", "entropy", "kl_ref", "log_ratio_p01", "log_ratio_p99")
    assert {k: UPDATE_METRICS[k] for k in SUM_METRICS + MEAN_METRICS} == {
        **dict.fromkeys(SUM_METRICS, Reduction.SUM),
        **dict.fromkeys(MEAN_METRICS, Reduction.TOKEN_MEAN),
    }
    gen = torch.Generator().manual_seed(11)
    keys = SUM_METRICS + MEAN_METRICS
    outputs = [{k: torch.rand((), generator=gen) for k in (*keys, "ratio_min", "ratio_max")} for _ in range(3)]
    for out, tokens in zip(outputs, (5.0, 12.0, 1.0)):
        out["tokens"] = torch.tensor(tokens)
    del outputs[1]["kl_ref"]  # a metric one micro-batch lacks counts 0 there
    mixed = [dict(out) for out in outputs]
    mixed[0]["entropy"] = outputs[0]["entropy"].double()
    mixed[2]["approx_kl"] = float(outputs[2]["approx_kl"])
    expected_tokens = 18.0
    for got in (reduce_update_metrics(outputs), reduce_update_metrics(mixed)):
        for k in SUM_METRICS:
            assert got[k] == pytest.approx(sum(float(o[k]) for o in outputs), rel=1e-12)
        for k in MEAN_METRICS:
            weighted = sum(float(o[k]) * float(o["tokens"]) for o in outputs if k in o)
            assert got[k] == pytest.approx(weighted / expected_tokens, rel=1e-6)
        assert got["ratio_min"] == min(float(o["ratio_min"]) for o in outputs)
        assert got["ratio_max"] == max(float(o["ratio_max"]) for o in outputs)
    assert reduce_update_metrics(outputs) == reduce_update_metrics([dict(o) for o in outputs])

    parts = [
        {OFFPOLICY + k: torch.rand((), generator=gen) * 10 for k in (*MISMATCH_SUMS, "weight_min", "weight_max")}
        for _ in range(2)
    ]
    totals = {k: sum(float(p[OFFPOLICY + k]) for p in parts) for k in MISMATCH_SUMS}
    totals["weight_min"] = min(float(p[OFFPOLICY + "weight_min"]) for p in parts)
    totals["weight_max"] = max(float(p[OFFPOLICY + "weight_max"]) for p in parts)
    got = reduce_offpolicy(parts)
    assert got.keys() == {OFFPOLICY + k for k in mismatch_metrics(totals)}
    for k, v in mismatch_metrics(totals).items():
        assert got[OFFPOLICY + k] == pytest.approx(v, rel=1e-6)


def test_on_policy_the_mismatch_of_the_update_pass_log_probs_is_measured() -> None:
    """On-policy the old policy is the update pass's own: its ratios are exactly 1, and the
    rollout mismatch measured from the pass's log-probs (as the trainer measures it)."""
    batch, mb, logp, entropy = objective_inputs(1)
    loss, out = PolicyObjective(AlgorithmConfig(), batch.num_tokens, batch.num_seqs)(
        torch.stack([logp, entropy], -1), mb
    )
    (metrics,) = measure_rollout_mismatch([logp.detach()], [mb], None)
    diff = [(float(logp.detach()[i, t]) - float(mb.rollout_logp[i, t])) for i, t in mb.mask.nonzero().tolist()]
    assert float(metrics["mismatch_sum"]) == pytest.approx(sum(abs(d) for d in diff), rel=1e-6)
    assert float(metrics["mismatch_max"]) == pytest.approx(max(abs(d) for d in diff), rel=1e-6)
    assert float(metrics["mismatch_tokens"]) == len(diff)
    _, log_ratios = log_ratio_percentiles([out[UPDATE_REPORT].tokens])
    assert log_ratios is not None and log_ratios.abs().max() == 0  # on-policy: the ratio is exactly 1
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    same = logprob_mismatch(logp, mb.rollout_logp, mb.mask)
    assert {k: float(v) for k, v in same.items()} == {k: float(metrics[k]) for k in same}


def test_objective_adds_kl_to_the_reference_and_the_entropy_bonus() -> None:
    batch, mb, logp, entropy = objective_inputs(2)
    mb.old_logp = logp.detach()
    mb.ref_logp = logp.detach() - 0.1
    le = torch.stack([logp, entropy], -1)
    plain, _ = PolicyObjective(AlgorithmConfig(), batch.num_tokens, batch.num_seqs)(le, mb)
    kl, out = PolicyObjective(AlgorithmConfig(kl_coef=0.5, kl_estimator="k1"), batch.num_tokens, batch.num_seqs)(le, mb)
    # k1 = logp - ref = 0.1 on every response token, token-mean over the step's 6 tokens
    tokens = float(mb.mask.sum())
    assert float((kl - plain).detach()) == pytest.approx(0.5 * 0.1 * tokens / batch.num_tokens, rel=1e-5)
    assert float(out[UPDATE_REPORT].metrics["kl_ref"]) == pytest.approx(0.1, rel=1e-5)
    bonus, _ = PolicyObjective(AlgorithmConfig(entropy_coef=0.2), batch.num_tokens, batch.num_seqs)(le, mb)
    assert float((plain - bonus).detach()) == pytest.approx(
        0.2 * float((entropy * mb.mask).sum()) / batch.num_tokens, rel=1e-5
    )


def test_the_kl_term_follows_the_losss_aggregation_and_kl_ref_is_a_token_mean() -> None:
    """GSPO without an ``agg``: its KL term aggregates as GSPO does (seq-mean-token-mean),
    and ``kl_ref`` is the token mean of the estimator whatever the aggregation."""
    batch, mb, logp, entropy = objective_inputs(3)
    mb.old_logp = logp.detach()
    mb.ref_logp = logp.detach() - torch.rand(logp.shape, generator=torch.Generator().manual_seed(4))
    le = torch.stack([logp, entropy], -1)
    algo = AlgorithmConfig(loss="gspo", kl_coef=0.5, kl_estimator="k1")
    with_kl, out = PolicyObjective(algo, batch.num_tokens, batch.num_seqs)(le, mb)
    plain, _ = PolicyObjective(AlgorithmConfig(loss="gspo"), batch.num_tokens, batch.num_seqs)(le, mb)
    kl = [float(logp[i, t] - mb.ref_logp[i, t]) for i, t in mb.mask.nonzero().tolist()]
    assert float(out[UPDATE_REPORT].metrics["kl_ref"]) == pytest.approx(sum(kl) / len(kl), rel=1e-5)
    rows = [
        [float(logp[i, t] - mb.ref_logp[i, t]) for t in row.nonzero().flatten().tolist()]
        for i, row in enumerate(mb.mask)
    ]
    seq_mean = sum(sum(r) / len(r) for r in rows if r) / batch.num_seqs
    assert float((with_kl - plain).detach()) == pytest.approx(0.5 * seq_mean, rel=1e-5)
    assert seq_mean != pytest.approx(sum(kl) / batch.num_tokens, rel=1e-3)  # the two aggregations differ here


def test_objective_under_a_rollout_correction_weighs_and_drops_tokens() -> None:
    """A micro-batch's correction: the loss is the policy loss over the kept tokens with
    the correction's weights, normalised by the kept counts (kept_counts, one process),
    and the entropy term leaves the dropped tokens out too."""
    from moe_rl.algorithms.rollout_correction import rollout_correction
    from moe_rl.trainer.objective import kept_counts

    batch, mb, logp, entropy = objective_inputs(4)
    mb.old_logp = (
        mb.rollout_logp
        + torch.tensor([[0.0, 0.9, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, -0.05, 0.0, 0.0]])[:, : mb.mask.shape[1]]
        * mb.mask
    )
    mb.correction = rollout_correction("token_mis", mb.old_logp, mb.rollout_logp, mb.mask, upper=2.0)
    assert 0 < mb.correction.keep.sum() < mb.mask.sum()  # exp(0.9) > 2: one token dropped
    tokens, seqs = kept_counts(batch, corrected=True)
    assert tokens == batch.num_tokens - 1 and seqs == batch.num_seqs
    algo = AlgorithmConfig(loss="grpo", entropy_coef=0.1)
    loss, out = PolicyObjective(algo, tokens, seqs)(torch.stack([logp, entropy], -1), mb)
    kept = mb.mask * mb.correction.keep
    ref, _ = policy_loss(
        "grpo",
        logp,
        mb.old_logp,
        mb.advantages,
        kept,
        token_weights=mb.correction.weights,
        num_tokens=tokens,
        num_seqs=seqs,
    )
    ref = ref - 0.1 * (entropy * kept).sum() / tokens
    torch.testing.assert_close(loss, ref)
    assert out[UPDATE_REPORT].metrics["tokens"] == kept.sum()


class RecordingEngine(RolloutEngine):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @property
    def weight_version(self) -> str:
        return "0"

    def generate(self, prompts, n, params, *, seed, return_routed_experts=False):
        raise AssertionError("not used")

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        self.calls.append(("disk", model_path, weight_version))


class FakeWeights:
    def __init__(self) -> None:
        self.exported: list[Path] = []

    def gather(self):
        return {"w": torch.ones(2)}

    def export(self, path: Path) -> Path:
        self.exported.append(path)
        return path


def test_weight_syncs(tmp_path: Path) -> None:
    engine, weights = RecordingEngine(), FakeWeights()
    DiskSync(engine, tmp_path / "w").push(weights, "3")
    assert weights.exported == [tmp_path / "w"] and engine.calls == [("disk", str((tmp_path / "w").resolve()), "3")]
    DiskSync(None, tmp_path / "w").push(weights, "4")  # another rank: exports its part, talks to no engine
    assert len(weights.exported) == 2 and len(engine.calls) == 1
    with pytest.raises(TypeError, match="InProcessWeightReceiver"):  # a disk-only engine takes no weights in process
        InProcessSync(engine)


def test_local_engine_rounds_weights_to_its_precision(tmp_path: Path) -> None:
    from moe_rl.models.hf_weights import SafetensorsDir
    from moe_rl.models.tiny import save_tiny_checkpoint
    from moe_rl.rollout.local import LocalEngine

    path = save_tiny_checkpoint(tmp_path / "m", "qwen3_moe", seed=4)
    exact, rounded = LocalEngine(path), LocalEngine(path, weight_precision=torch.bfloat16)
    for name, value in exact.model.state_dict().items():
        torch.testing.assert_close(rounded.model.state_dict()[name], value.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert any((v != v.to(torch.bfloat16).float()).any() for v in exact.model.state_dict().values())
    reader = SafetensorsDir(path)
    update = {k: reader.get(k) + 1e-3 for k in reader.keys()}  # HF checkpoint names, as the trainer sends them
    rounded.update_weights(update, "1")
    norm = "model.norm.weight"
    torch.testing.assert_close(
        rounded.model.state_dict()[norm], update[norm].to(torch.bfloat16).float(), rtol=0, atol=0
    )
    assert rounded.weight_version == "1"


def test_config_sections_are_the_layout_and_optimizer_types() -> None:
    cfg = load_config(
        None, ["parallel.tp=2", "parallel.ep=2", "optim.lr=1e-5", "optim.extra={decoupled_weight_decay: false}"]
    )
    assert isinstance(cfg.parallel, ParallelLayout) and isinstance(cfg.optim, OptimSettings)
    assert cfg.parallel.seq_len_multiple == 2 and ParallelLayout().seq_len_multiple == 1
    assert cfg.optim.lr == 1e-5 and cfg.optim.extra == {"decoupled_weight_decay": False}


def test_a_launched_server_never_shares_the_trainers_gpus() -> None:
    from moe_rl.rollout.sglang.server import ServerSettings, check_server_gpus

    check_server_gpus([], [])  # a CPU machine
    check_server_gpus([8, 9], ["0", "1", "2", "3"])
    with pytest.raises(ValueError, match="overlaps the trainer's GPUs .* \\['3'\\]"):
        check_server_gpus([3, 4], ["0", "1", "2", "3"])
    with pytest.raises(ValueError, match="needs rollout.server.gpus"):
        check_server_gpus([], ["0"])
    env = ServerSettings(model_path="m", gpus=(4, 5)).environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    with pytest.raises(ConfigError, match="fewer GPUs than rollout.server.tp=2"):
        load_config(
            None,
            ["rollout.engine=sglang", "rollout.server.launch=true", "rollout.server.tp=2", "rollout.server.gpus=[3]"],
        )


def test_a_server_launched_without_cuda_gets_sglangs_cpu_backend(monkeypatch) -> None:
    """No CUDA: SGLang's CPU flags and environment, no deterministic inference (it needs
    CUDA kernels), the configured Python and extra flags last (they win)."""
    from moe_rl.rollout.sglang.server import CPU_SERVER_ARGS
    from moe_rl.experience.builders import server_settings

    cfg = load_config(
        None,
        [
            "rollout.engine=sglang",
            "rollout.server.launch=true",
            f"rollout.server.python={sys.executable}",
            "rollout.server.args=[--max-total-tokens, '8192']",
        ],
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = lambda: server_settings(cfg.rollout.server, "model-dir", return_routed_experts=True, seed=1)  # noqa: E731
    cpu = settings()
    command = cpu.command()
    assert (
        command[:3] == [sys.executable, "-m", "sglang.launch_server"]
        and "--enable-deterministic-inference" not in command
    )
    start = command.index("--device")
    assert tuple(command[start : start + len(CPU_SERVER_ARGS)]) == CPU_SERVER_ARGS and command[-2:] == [
        "--max-total-tokens",
        "8192",
    ]
    assert cpu.environment()["SGLANG_USE_CPU_ENGINE"] == "1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = settings()
    assert (
        "--enable-deterministic-inference" not in gpu.command() and "--device" not in gpu.command()
    )  # off by default: slower
    cfg.rollout.server.deterministic = True
    assert "--enable-deterministic-inference" in settings().command()
    assert gpu.environment().get("SGLANG_USE_CPU_ENGINE") == os.environ.get("SGLANG_USE_CPU_ENGINE")  # inherited only


def test_export_never_writes_over_a_directory_that_is_not_an_export(tmp_path: Path) -> None:
    from moe_rl.models.export_dir import export_destination_problem, write_marker

    assert export_destination_problem(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert export_destination_problem(tmp_path / "empty") is None
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    assert "is not empty and was not written by moe-rl export" in export_destination_problem(tmp_path / "work")
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in export_destination_problem(tmp_path / "file")
    (tmp_path / "base").mkdir()  # a model directory is not an export
    (tmp_path / "base" / "model.safetensors.index.json").write_text("{}")
    assert "was not written by moe-rl export" in export_destination_problem(tmp_path / "base")
    (tmp_path / "earlier").mkdir()
    write_marker(tmp_path / "earlier", dtype="float32")
    (tmp_path / "earlier" / "model.safetensors.index.json").write_text("{}")
    assert export_destination_problem(tmp_path / "earlier") is None
    (tmp_path / "link").symlink_to(tmp_path / "earlier")
    assert "is a symbolic link" in export_destination_problem(tmp_path / "link")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "base",
        "earlier",
        "empty",
        "file",
        "link",
        "work",
    ]  # no probe left


def test_a_run_dir_belongs_to_one_run(tmp_path: Path) -> None:
    import json

    from moe_rl.checkpoint.catalog import FORMAT
    from moe_rl.checkpoint.run_dir import check_run_dir

    def cfg(*overrides: str):
        return load_config(None, [f"train.run_dir={tmp_path / 'run'}", *overrides])

    check_run_dir(cfg())  # new: fine
    step = tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(
        json.dumps({"format": FORMAT, "step": 4, "world_size": 1, "fingerprint": cfg().fingerprint()})
    )
    check_run_dir(cfg("train.steps=50", "optim.lr=1e-5"))  # same run, more steps, another learning rate
    check_run_dir(cfg("parallel.tp=2", "parallel.ep=2"))  # ... or another layout (checkpoints reshard)
    with pytest.raises(ConfigError, match="already holds a run's checkpoints.*nothing was deleted"):
        check_run_dir(cfg("train.resume=false"))
    with pytest.raises(ConfigError, match="another config \\(algorithm.loss: 'grpo' -> 'gspo'; train.seed: 1 -> 2\\)"):
        check_run_dir(cfg("algorithm.loss=gspo", "train.seed=2"))
    check_run_dir(cfg("algorithm.loss=gspo", "train.resume_anyway=true"))
    assert step.is_dir()
    (step / "meta.json").write_text(
        json.dumps({"step": 4, "world_size": 1, "fingerprint": cfg().fingerprint()})
    )  # format 1
    with pytest.raises(
        ConfigError, match=f"checkpoint {step} was written by an earlier moe-rl.*model.hf_dir={step / 'model'}"
    ):
        check_run_dir(cfg())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        check_run_dir(load_config(None, [f"train.run_dir={tmp_path / 'file' / 'run'}"]))


def test_dp_reshardable_checkpoints_resume_only_where_data_parallel_changes(tmp_path: Path) -> None:
    """train.checkpoint_reshardable=false (megatron's dp_reshardable): a layout whose TP / PP /
    EP / ETP / stage split differs from the recorded one is refused in one line; DP (the
    world size) may change; a fully_reshardable (or unrecorded) checkpoint resumes anywhere."""
    from moe_rl.checkpoint.catalog import DP_RESHARDABLE, RESHARDABLE, layout_meta, layout_problem
    from parallel.layout import ParallelLayout

    saved = ParallelLayout(tp=2, pp=2, ep=4)
    meta = {"layout": layout_meta(saved), "world_size": 16, "optimizer_sharding": DP_RESHARDABLE}
    assert layout_problem(tmp_path, meta, saved) is None  # any world size: only DP differs then
    for other in (
        ParallelLayout(tp=1, pp=2, ep=4),
        ParallelLayout(tp=2, pp=2, ep=2),
        ParallelLayout(tp=2, pp=2, ep=4, etp=1),
        ParallelLayout(tp=2, pp=2, ep=4, first_stage_layers=3),
    ):
        problem = layout_problem(tmp_path, meta, other)
        assert (
            problem
            and "\n" not in problem
            and "train.checkpoint_reshardable=false under tp=2 pp=2 ep=4 etp=2" in problem
        )
    assert "first_stage_layers=3" in layout_problem(
        tmp_path, meta, ParallelLayout(tp=2, pp=2, ep=4, first_stage_layers=3)
    )
    for sharding in (RESHARDABLE, None):
        assert layout_problem(tmp_path, {**meta, "optimizer_sharding": sharding}, ParallelLayout()) is None


def test_resume_skips_checkpoints_that_cannot_load(tmp_path: Path, caplog) -> None:
    import json

    from moe_rl.checkpoint.catalog import FORMAT, CheckpointMismatch, select_checkpoint

    def make(
        step: int,
        meta: str | None = None,
        files: tuple[str, ...] = ("dist/metadata.json", "dist/.metadata", "dist/common.pt", "rng/rank_00000.pt"),
    ) -> Path:
        path = tmp_path / "checkpoints" / f"step_{step:06d}"
        for sub in files:
            (path / sub).parent.mkdir(parents=True, exist_ok=True)
            (path / sub).write_text("x")
        path.mkdir(parents=True, exist_ok=True)
        (path / "meta.json").write_text(
            meta if meta is not None else json.dumps({"format": FORMAT, "step": step, "world_size": 4})
        )
        return path

    make(2)  # files present, no manifest: checked as far as they go (real ones: test_reliability.py)
    make(4, files=("dist/metadata.json", "rng/rank_00000.pt"))  # sharded state lost
    make(6, meta="")  # torn meta.json
    with caplog.at_level("WARNING", logger="moe_rl.train"), pytest.raises(CheckpointMismatch, match="no intact"):
        select_checkpoint(tmp_path)
    assert "meta.json is empty or unreadable" in caplog.text and "dist/.metadata is missing" in caplog.text
    assert "step_000002: dist/metadata.json is unreadable" in caplog.text
    make(8, meta=json.dumps({"step": 8, "world_size": 1}), files=("optim/rank_00000.pt",))  # an earlier moe-rl's format
    with pytest.raises(CheckpointMismatch, match="written by an earlier moe-rl .*cannot be resumed.*model.hf_dir="):
        select_checkpoint(tmp_path)


def test_token_budget_plans_balance_ranks_and_bound_micro_batches() -> None:
    from moe_rl.trainer.packing import fixed_plan, round_up, token_budget_plan

    lengths = [10 + (i * 7919) % 491 for i in range(64)]  # 10..500 tokens, spread
    budget, ranks = 1024, 4
    plans = [token_budget_plan(lengths, r, ranks, budget, max_rows=32, multiple=8) for r in range(ranks)]
    placed = [i for plan in plans for mb in plan for i in mb if i is not None]
    assert sorted(placed) == list(range(64))  # every sample once
    assert len({len(plan) for plan in plans}) == 1  # every rank runs as many micro-batches
    for plan in plans:
        for mb in plan:
            real = [lengths[i] for i in mb if i is not None]
            assert len(real) == 1 or len(real) * round_up(max(real), 8) <= budget
    loads = [sum(lengths[i] for mb in plan for i in mb if i is not None) for plan in plans]
    assert max(loads) - min(loads) <= max(lengths)  # longest-first to the least loaded rank

    def padding(plan_of_rank, pad_each: bool) -> float:
        longest_all = round_up(max(lengths), 8)
        padded = sum(
            len(mb) * (round_up(max([lengths[i] for i in mb if i is not None] or [2]), 8) if pad_each else longest_all)
            for plan in plan_of_rank
            for mb in plan
        )
        return 1 - sum(lengths) / padded

    fixed = [fixed_plan(range(r, 64, ranks), 16, 8) for r in range(ranks)]
    assert padding(plans, True) < 0.2 < 0.4 < padding(fixed, False)


def test_the_default_budget_pads_little_and_no_micro_batch_outgrows_fixed_rows() -> None:
    """DAPO-like long-tailed lengths (lognormal responses, median ~1,500 tokens, cut at 8,192)
    on 4 ranks: the derived budget (micro_batch_size x the mean length) pads <= 15% where
    fixed rows padded to the step's longest (the old default) pad over half; no micro-batch
    holds more padded tokens than a fixed one could."""
    import random

    from moe_rl.trainer.packing import MicroBatchPlanner, derived_budget, fixed_plan, round_up, token_budget_plan

    gen = random.Random(0)
    lengths = [
        min(512, max(32, int(gen.lognormvariate(5.0, 0.5)))) + min(8192, max(1, int(gen.lognormvariate(7.3, 0.9))))
        for _ in range(256)
    ]
    ranks, rows = 4, 8
    budget = derived_budget(lengths, rows, 8)
    assert budget == rows * round_up(-(-sum(lengths) // len(lengths)), 8) == derived_budget(lengths[::-1], rows, 8)
    plans = [token_budget_plan(lengths, r, ranks, budget, rows, 8) for r in range(ranks)]
    assert sorted(i for plan in plans for mb in plan for i in mb if i is not None) == list(range(256))
    assert len({len(plan) for plan in plans}) == 1
    sizes = [
        len(mb) * round_up(max([lengths[i] for i in mb if i is not None] or [2]), 8) for plan in plans for mb in plan
    ]
    assert max(sizes) <= rows * round_up(max(lengths), 8)
    fixed = [fixed_plan(range(r, 256, ranks), 64, rows) for r in range(ranks)]
    fixed_padded = sum(len(mb) for plan in fixed for mb in plan) * round_up(max(lengths), 8)
    assert 1 - sum(lengths) / sum(sizes) <= 0.15 and 1 - sum(lengths) / fixed_padded > 0.5
    # the planner packs by the derived budget unless told otherwise (one process: rank 0 of 1)
    assert MicroBatchPlanner(rows, seq_len_multiple=8).plan(lengths) == token_budget_plan(
        lengths, 0, 1, budget, rows, 8
    )
    assert MicroBatchPlanner(rows, max_tokens=0).plan(lengths) == fixed_plan(range(256), 256, rows)


def test_the_default_budget_takes_rows_for_samples_of_nearly_one_length() -> None:
    """32 samples of 7-10 tokens under micro_batch_size=32: packing by the derived budget
    (32 x the mean) splits them 28 + 4, twice a micro-batch's fixed cost for 12 padding
    tokens; the planner takes the one micro-batch of rows. With an explicit budget it packs."""
    from moe_rl.trainer.packing import MicroBatchPlanner, derived_budget, fixed_plan, padded_tokens, token_budget_plan

    lengths = [7 + (i * 7) % 4 for i in range(32)]
    packed = token_budget_plan(lengths, 0, 1, derived_budget(lengths, 32, 1), 32, 1)
    rows = fixed_plan(range(32), 32, 32)
    assert [len(mb) for mb in packed] == [28, 4]
    assert padded_tokens([rows], lengths, 1) <= 1.25 * padded_tokens([packed], lengths, 1)
    assert MicroBatchPlanner(32).plan(lengths) == rows
    assert MicroBatchPlanner(32, max_tokens=288).plan(lengths) == packed
    # spread lengths: rows would pad far more, the packing stays
    spread = [10 + (i * 7919) % 491 for i in range(64)]
    assert MicroBatchPlanner(8).plan(spread) == token_budget_plan(spread, 0, 1, derived_budget(spread, 8, 1), 8, 1)


def test_token_budget_micro_batches_give_the_full_batch_loss() -> None:
    from moe_rl.trainer.packing import token_budget_plan

    rows = 9
    samples = [sample([1, 2], [3] * (1 + (i * 5) % 7), i) for i in range(rows)]
    exp = Experience(samples, torch.zeros(rows, 1), ["r"], torch.linspace(-1, 2, rows))
    width = max(exp.lengths) - 1

    def total(plan) -> tuple[float, torch.Tensor]:
        batch = build_train_batch(
            exp, 0, plan, seq_len_multiple=1, pad_id=0, device=torch.device("cpu"), with_routing=True
        )
        objective = PolicyObjective(AlgorithmConfig(loss="grpo"), batch.num_tokens, batch.num_seqs)
        weights = torch.zeros(rows, width, requires_grad=True)
        value = 0.0
        for mb in batch.micro_batches:
            real = [i for i in mb.sample_indices if i >= 0]
            t = mb.mask.shape[1]
            logp = torch.zeros(mb.mask.shape)
            logp[: len(real)] = weights[real, :t] - 0.5
            mb.old_logp = -0.45 + 0.05 * torch.arange(t).expand(mb.mask.shape)
            loss, _ = objective(torch.stack([logp, torch.zeros_like(logp)], -1), mb)
            loss.backward()
            value += float(loss.detach())
        return value, weights.grad, batch

    whole, grad_whole, _ = total([list(range(rows))])
    packed, grad_packed, batch = total(token_budget_plan(exp.lengths, 0, 1, 20, 8, 1))
    assert len(batch.micro_batches) > 2 and len({mb.input_ids.shape for mb in batch.micro_batches}) > 1
    for mb in batch.micro_batches:  # each padded to its own longest sample
        assert mb.input_ids.shape[1] == max(exp.lengths[i] for i in mb.sample_indices if i >= 0)
    assert packed == pytest.approx(whole, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad_packed, grad_whole)
    real, padded = batch.padding
    assert real == sum(exp.lengths) and padded < rows * max(exp.lengths)


def test_tensorboard_scalars_of_a_step_are_one_event_and_read_back_by_tag(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    from moe_rl.trainer.metrics import BackgroundWriter

    from torch.utils.tensorboard.summary import histogram

    writer = BackgroundWriter(SummaryWriter(str(tmp_path)))
    values = {step: torch.randn(500, generator=torch.Generator().manual_seed(step)) * step for step in (1, 2)}
    for step in (1, 2):
        for i in range(5):
            writer.add_scalar(f"a/x{i}", step * 10 + i, step)
        writer.add_histogram("h", values[step], step)
        writer.add_scalar("b/late", step / 2, step)  # after another kind of call: its own event
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0}).Reload()
    for i in range(5):
        assert [(e.step, e.value) for e in events.Scalars(f"a/x{i}")] == [(1, 10 + i), (2, 20 + i)]
    assert [(e.step, e.value) for e in events.Scalars("b/late")] == [(1, 0.5), (2, 1.0)]
    assert [e.step for e in events.Histograms("h")] == [1, 2]
    (path,) = tmp_path.glob("events.out.tfevents.*")
    scalar_events = [
        e
        for e in LegacyEventFileLoader(str(path)).Load()
        if e.HasField("summary") and e.summary.value[0].HasField("simple_value")
    ]
    assert [(e.step, len(e.summary.value)) for e in scalar_events] == [(1, 5), (1, 1), (2, 5), (2, 1)]
    # the histograms are torch's own with TensorBoard's default bins, bucket for bucket
    histograms = [
        e
        for e in LegacyEventFileLoader(str(path)).Load()
        if e.HasField("summary") and e.summary.value[0].HasField("histo")
    ]
    default_bins = SummaryWriter(str(tmp_path / "other")).default_bins
    assert [(e.step, e.summary.value[0].histo) for e in histograms] == [
        (step, histogram("h", values[step], default_bins).value[0].histo) for step in (1, 2)
    ]


def test_routing_of_more_than_256_experts_travels_as_bytes() -> None:
    """int16 expert ids (Kimi-K2's 384 experts) go to other ranks as bytes (NCCL has no
    int16) and come back as the same int16 tensor."""
    from moe_rl.routing.encoding import expert_index_dtype
    from moe_rl.trainer.experience_transport import _as_bytes

    routing = torch.randint(0, 384, (7, 3, 8)).to(expert_index_dtype(384))
    wire = _as_bytes(routing)
    assert routing.dtype == torch.int16 and wire.dtype == torch.uint8 and wire.numel() == routing.numel() * 2
    assert torch.equal(wire.view(torch.int16).reshape(routing.shape), routing)


def test_an_export_writes_its_dtype_without_changing_the_callers_config(tmp_path: Path, monkeypatch) -> None:
    """The export's config.json names the exported dtype; the hf_config the trainer holds
    (and writes into every later checkpoint's hf/) keeps the base model's."""
    import json

    from moe_rl.models import hf_weights
    from moe_rl.models.tiny import tiny_config

    hf_config = tiny_config("qwen3_moe")
    before = hf_config.dtype
    monkeypatch.setattr(hf_weights, "gather_hf_tensors", lambda *a, **k: {})
    hf_weights._write_export(None, hf_config, tmp_path, torch.bfloat16, None, 0)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert hf_config.dtype == before and before != torch.bfloat16


def test_quantiles_equal_torch_quantile_and_take_more_than_two_to_the_24_values() -> None:
    """torch.quantile refuses more than 2^24 values (a rank's step at 512 x 32k tokens holds
    more): the percentiles' own sort gives its results, at any size."""
    from moe_rl.trainer.objective import quantiles

    points = torch.tensor([0.01, 0.5, 0.99])
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 7, 1000):
        values = torch.randn(n, generator=gen)
        torch.testing.assert_close(quantiles(values, points), torch.quantile(values, points), rtol=0, atol=1e-6)
    n = 2**24 + 1
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(torch.zeros(n), points)
    shuffled = torch.randperm(n, generator=gen).float()  # quantile q is q * 2^24 (to fp32's rounding)
    assert quantiles(shuffled, points).tolist() == pytest.approx([0.01 * 2**24, 0.5 * 2**24, 0.99 * 2**24], rel=1e-7)


def test_a_run_that_already_reached_its_steps_says_so(tmp_path, capsys) -> None:
    from moe_rl.trainer.metrics import StepLogger

    logger = StepLogger(tmp_path / "r5", 4, 4, enabled=True, progress=False)
    logger.summary(0, {}, None, 0.0)
    assert (
        capsys.readouterr().err.strip()
        == "r5: nothing to do, its checkpoints already reach train.steps (raise it to go on)"
    )
