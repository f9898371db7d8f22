"""The policy objective of one step: the configured policy loss, the optional KL to a
reference and entropy bonus. Each micro-batch's :class:`UpdateReport` holds what the update
measured: metric values under the names of :mod:`moe_rl.algorithms.metric_spec` (reduced
by :mod:`moe_rl.trainer.metrics`) and the per-token figures the routing monitor reads
(:class:`UpdateTokens`). Nothing is written into the batch, nothing read back to the host."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from moe_rl.algorithms import entropy_bonus, kl_divergence, kl_penalty, loss_defaults, policy_loss
from moe_rl.algorithms.metric_spec import LOSS_TOKEN_FIGURES, TOKENS
from moe_rl.config import AlgorithmConfig
from moe_rl.trainer.batch import PolicyMicroBatch, TrainBatch
from parallel.collectives import all_reduce, reports_loss

UPDATE_REPORT = "update"  # the key of a micro-batch's UpdateReport in run_microbatches' output


@dataclass(frozen=True)
class UpdateTokens:
    """One micro-batch's per-token figures of an update pass, ``[b, s-1]`` each, detached
    (:meth:`moe_rl.routing.monitor.RoutingMonitor.add_update_tokens` reads them)."""

    log_ratio: Tensor  # log-prob - old log-prob
    clipped: Tensor  # 1 where the loss's objective is clipped
    mask: Tensor  # the tokens in the loss (a rollout correction's dropped ones left out)


@dataclass(frozen=True)
class UpdateReport:
    """What the objective measured on one micro-batch."""

    metrics: dict[str, Tensor]  # scalar values named in moe_rl.algorithms.metric_spec.UPDATE_METRICS
    tokens: UpdateTokens


def kept_counts(batch: TrainBatch, corrected: bool) -> tuple[float, float]:
    """The step's response tokens, and responses with at least one token, left in the loss
    (the losses' normalisers). Collective when ``corrected`` (a rollout correction is
    configured: the same on every rank): the reporting ranks count their kept tokens."""
    if not corrected:
        return batch.num_tokens, batch.num_seqs
    local = torch.zeros(2, dtype=torch.float64)
    if reports_loss() and batch.micro_batches:
        counts = []
        for mb in batch.micro_batches:
            keep = mb.mask * mb.correction.keep if mb.correction is not None else mb.mask
            counts.append(torch.stack([keep.sum(), (keep.sum(-1) > 0).sum()]).to(torch.float64))
        for row in torch.stack(counts).cpu():  # one device-to-host copy for the step
            local += row
    kept = all_reduce(local)
    return float(kept[0]), float(kept[1])


@dataclass(frozen=True)
class PolicyObjective:
    """``loss_fn`` of :func:`moe_rl.models.forward.run_microbatches` for one step; each
    micro-batch's output holds its :class:`UpdateReport` under ``UPDATE_REPORT``.

    ``num_tokens`` / ``num_seqs`` are the whole step's counts (of the tokens a rollout
    correction keeps), so micro-batch losses (and data-parallel ranks') sum to the full
    batch's loss; a micro-batch's ``correction`` weights its loss terms and drops tokens.
    Metrics: the loss's own (clip fraction, ratios, approx KL), ``pg_loss``, ``loss``,
    ``entropy``, ``kl_ref`` (with a reference) and ``tokens``; the log-ratio percentiles come
    after the pass (:func:`log_ratio_percentiles`). On-policy (no ``old_logp``) the old
    policy is this pass's own.
    """

    algorithm: AlgorithmConfig
    num_tokens: float
    num_seqs: float

    def __call__(self, logp_entropy: Tensor, mb: PolicyMicroBatch) -> tuple[Tensor, dict[str, UpdateReport]]:
        a = self.algorithm
        logp, entropy = logp_entropy[..., 0], logp_entropy[..., 1]
        mask = mb.mask if mb.correction is None else mb.mask * mb.correction.keep  # dropped tokens leave every term
        old = mb.old_logp if mb.old_logp is not None else logp.detach()  # on-policy: the old policy is this one
        params = {**a.loss_params, "num_tokens": self.num_tokens, "num_seqs": self.num_seqs}
        if mb.correction is not None:
            params["token_weights"] = mb.correction.weights
        loss, reported = policy_loss(a.loss, logp, old, mb.advantages, mask, **params)
        metrics = {k: v for k, v in reported.items() if k not in LOSS_TOKEN_FIGURES}
        metrics["pg_loss"] = loss.detach()
        agg = str(a.loss_params.get("agg") or loss_defaults(a.loss)["agg"])  # the KL and entropy terms as the loss
        common = dict(num_tokens=self.num_tokens, num_seqs=self.num_seqs)
        if a.kl_coef > 0:
            if mb.ref_logp is None:
                raise ValueError("a KL term needs the reference log-probs (compute_reference_logprobs)")
            kl = kl_penalty(logp, mb.ref_logp, mask, a.kl_estimator, agg, **common)
            loss = loss + a.kl_coef * kl
            per_token = kl_divergence(logp.detach(), mb.ref_logp, a.kl_estimator)
            metrics["kl_ref"] = (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # a token mean, whatever agg
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * entropy_bonus(entropy, mask, agg, **common)
        metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        metrics["loss"] = loss.detach()
        metrics[TOKENS] = mask.sum()
        tokens = UpdateTokens(logp.detach() - old, reported["token_clipped"], mask)
        return loss, {UPDATE_REPORT: UpdateReport(metrics, tokens)}


def log_ratio_percentiles(tokens: Sequence[UpdateTokens]) -> tuple[list[dict[str, Tensor]], Tensor | None]:
    """The 1st/99th percentiles of the pass's masked token log-ratios on this rank, over all
    its micro-batches, given to each micro-batch with tokens (so the token-weighted mean the
    step's metrics take gives them back, whatever the micro-batch split; across data-parallel
    ranks it is that mean of each rank's), and all the log-ratios in micro-batch order (the
    histogram's; ``None`` without micro-batches). After the pass: one boolean selection and
    one device sync (inside the loss, each micro-batch's selection stalled the pass on a GPU)."""
    if not tokens:
        return [], None
    keep = [t.mask.bool() for t in tokens]
    counts = torch.stack([k.sum() for k in keep]).tolist()
    selected = torch.cat([t.log_ratio.reshape(-1) for t in tokens])[torch.cat([k.reshape(-1) for k in keep])]
    if not selected.numel():
        return [{} for _ in tokens], selected
    p01, p99 = quantiles(selected, _percentile_points(selected.device))
    pass_percentiles = {"log_ratio_p01": p01, "log_ratio_p99": p99}
    return [pass_percentiles if count else {} for count in counts], selected


def quantiles(values: Tensor, points: Tensor) -> Tensor:
    """``torch.quantile(values, points)`` (linear interpolation) of a 1-D tensor of any size
    (torch.quantile refuses more than 2^24 values: a rank's step can hold more tokens), in
    fp32 at least; one sort, no host read."""
    ordered = values.to(torch.promote_types(values.dtype, torch.float32)).sort().values
    at = points.to(ordered.dtype) * (ordered.numel() - 1)
    low, high = at.floor().long(), at.ceil().long()
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


@functools.cache
def _percentile_points(device: torch.device) -> Tensor:
    """The 1st and 99th percentile points on ``device`` (copied there once, not a copy, and
    on a GPU a sync, per pass)."""
    return torch.tensor([0.01, 0.99], device=device)
