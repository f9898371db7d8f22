"""The metric specification (moe_rl/algorithms/metric_spec.py): every metric the losses,
the objective and the mismatch measurement write has a declared reduction, and the
reductions give the figures a direct computation over all of a step's tokens gives."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algorithms import policy_loss
from moe_rl.algorithms.losses import POLICY_LOSSES
from moe_rl.algorithms.metric_spec import (
    LOGGED_UPDATE_METRICS,
    LOSS_TOKEN_FIGURES,
    ROLLOUT_MISMATCH_METRICS,
    UPDATE_METRICS,
    Reduction,
)
from moe_rl.algorithms.rollout_correction import rollout_correction
from moe_rl.config import AlgorithmConfig
from moe_rl.experience.types import Experience
from moe_rl.rollout.types import Sample
from moe_rl.trainer.batch import PolicyMicroBatch, build_train_batch
from moe_rl.trainer.metrics import logp_mismatch_scalars, reduce_metrics
from moe_rl.trainer.objective import UPDATE_REPORT, PolicyObjective, log_ratio_percentiles
from moe_rl.trainer.packing import fixed_plan
from moe_rl.trainer.rollout_mismatch import logprob_mismatch

# each loss once, and the parameters that add a metric of the loss's own
LOSS_CASES = [(name, {}) for name in POLICY_LOSSES.names()] + [("grpo", {"dual_clip": 3.0})]


def inputs(seed: int, rows: int = 3, width: int = 6):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=gen) - 0.1
    old = logp + 0.3 * torch.randn(rows, width, generator=gen)
    mask = (torch.rand(rows, width, generator=gen) < 0.7).float()
    mask[:, 0] = 1.0
    adv = torch.randn(rows, generator=gen)
    return logp, old, adv, mask


def micro_batch(seed: int) -> tuple[PolicyMicroBatch, torch.Tensor, torch.Tensor]:
    """A micro-batch of three samples, and log-probs and entropies for it."""
    samples = [Sample([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], "stop", "0", i) for i in range(3)]
    exp = Experience(samples, torch.zeros(3, 1), ["r"], torch.tensor([1.0, -1.0, 0.5]))
    batch = build_train_batch(
        exp,
        0,
        fixed_plan([0, 1, 2], 3, 3),
        seq_len_multiple=1,
        pad_id=0,
        device=torch.device("cpu"),
        with_routing=False,
    )
    (mb,) = batch.micro_batches
    gen = torch.Generator().manual_seed(seed)
    return mb, -torch.rand(mb.mask.shape, generator=gen), torch.rand(mb.mask.shape, generator=gen)


@pytest.mark.parametrize("name,params", LOSS_CASES)
def test_every_metric_a_loss_reports_has_a_declared_reduction(name: str, params: dict) -> None:
    logp, old, adv, mask = inputs(0)
    _, metrics = policy_loss(name, logp, old, adv, mask, **params)
    for key, value in metrics.items():
        if key in LOSS_TOKEN_FIGURES:
            assert value.shape == logp.shape, key
        else:
            assert key in UPDATE_METRICS and value.dim() == 0, key


def test_every_metric_the_objective_and_the_mismatch_write_has_a_declared_reduction() -> None:
    mb, logp, entropy = micro_batch(1)
    mb.old_logp = logp.detach() + 0.05
    mb.ref_logp = logp.detach() - 0.1
    mb.correction = rollout_correction("token_tis", mb.old_logp, mb.rollout_logp, mb.mask, upper=2.0)
    algo = AlgorithmConfig(loss="grpo", kl_coef=0.1, entropy_coef=0.01, loss_params={"dual_clip": 3.0})
    _, out = PolicyObjective(algo, 10.0, 3.0)(torch.stack([logp, entropy], -1), mb)
    report = out[UPDATE_REPORT]
    (percentiles,), _ = log_ratio_percentiles([report.tokens])
    assert set(report.metrics) | set(percentiles) <= set(UPDATE_METRICS)
    assert set(LOGGED_UPDATE_METRICS) <= set(report.metrics) | set(percentiles)
    assert set(logprob_mismatch(logp, mb.rollout_logp, mb.mask, mb.correction)) == set(ROLLOUT_MISMATCH_METRICS)
    declared = [*UPDATE_METRICS.values(), *ROLLOUT_MISMATCH_METRICS.values()]
    assert all(isinstance(r, Reduction) for r in declared)


def test_reductions_equal_the_figures_over_all_tokens_at_once() -> None:
    """Token means over micro-batches of different sizes equal the mean over the step's
    tokens taken at once; sums add up; the extremes are the step's."""
    parts = [inputs(seed, rows=rows, width=width) for seed, rows, width in ((1, 2, 5), (2, 4, 7), (3, 1, 3))]
    values = []
    for logp, old, adv, mask in parts:
        _, metrics = policy_loss("grpo", logp, old, adv, mask)
        entropy = (-logp * mask).sum() / mask.sum()
        values.append({**metrics, "entropy": entropy, "tokens": mask.sum()})
        values[-1].update(logprob_mismatch(logp, old, mask))  # ("old" as the rollout's log-probs)
    logp, old, adv, mask = inputs(4, rows=2, width=3)  # a micro-batch without tokens (a rank's padding)
    _, empty = policy_loss("grpo", logp, old, adv, torch.zeros_like(mask))
    assert (float(empty["ratio_min"]), float(empty["ratio_max"])) == (math.inf, -math.inf)
    values.append({**empty, "tokens": torch.tensor(0.0)})
    reduced = reduce_metrics(values, {**UPDATE_METRICS, **ROLLOUT_MISMATCH_METRICS})

    flat = lambda f: torch.cat([f(p)[p[3].bool()] for p in parts]).double()  # noqa: E731
    log_ratio = flat(lambda p: p[0] - p[1])
    all_logp = flat(lambda p: p[0])
    adv = flat(lambda p: p[2].unsqueeze(1).expand_as(p[0]))
    ratio = log_ratio.exp()
    clipped = (-adv * ratio.clamp(0.8, 1.2)) > (-adv * ratio)
    assert reduced["clip_frac"] == pytest.approx(float(clipped.double().mean()), rel=1e-6)
    assert reduced["ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-6)
    assert reduced["entropy"] == pytest.approx(float(-all_logp.mean()), rel=1e-6)
    assert reduced["ratio_min"] == pytest.approx(float(ratio.min()), rel=1e-6)
    assert reduced["ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-6)
    assert reduced["tokens"] == float(len(log_ratio))
    mismatch = logp_mismatch_scalars(reduced)
    assert mismatch["logp_mismatch_mean"] == pytest.approx(float(log_ratio.abs().mean()), rel=1e-6)
    assert mismatch["logp_mismatch_max"] == pytest.approx(float(log_ratio.abs().max()), rel=1e-6)


def test_a_token_mean_without_the_micro_batch_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="tokens"):
        reduce_metrics([{"entropy": torch.tensor(0.5)}], UPDATE_METRICS)
