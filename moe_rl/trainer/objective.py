"""The policy objective of one step: the configured policy loss, the optional KL to a
reference and entropy bonus, and what the update measures — all returned as metrics
(nothing is written into the batch)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algorithms import entropy_bonus, kl_penalty, policy_loss
from moe_rl.algorithms.rollout_correction import Correction, mismatch_sums
from moe_rl.config import AlgorithmConfig
from moe_rl.trainer.batch import PolicyMicroBatch, TrainBatch
from parallel.collectives import all_reduce, reports_loss

# token-weighted means over micro-batches and ranks (loss terms are already global sums)
MEAN_METRICS = ("clip_frac", "ratio_mean", "approx_kl", "entropy", "kl_ref", "log_ratio_p01", "log_ratio_p99")
SUM_METRICS = ("loss", "pg_loss")


OFFPOLICY = "offpolicy/"  # prefix of the off-policy diagnostics' sums in a micro-batch's metrics


def logprob_mismatch(
    logp: Tensor, rollout_logp: Tensor, mask: Tensor, correction: Correction | None = None
) -> dict[str, Tensor]:
    """``|trainer log-prob - rollout log-prob|`` over response tokens: its sum, max and
    token count (reduced over micro-batches and ranks into a mean and a max), and the
    off-policy diagnostics' sums (:func:`moe_rl.algorithms.rollout_correction.mismatch_sums`,
    keys prefixed ``offpolicy/``) under ``correction`` if there is one."""
    diff = (logp.detach() - rollout_logp).abs() * mask
    return {
        "mismatch_sum": diff.sum(),
        "mismatch_max": diff.max() if diff.numel() else diff.new_zeros(()),
        "mismatch_tokens": mask.sum(),
        **{OFFPOLICY + k: v for k, v in mismatch_sums(logp, rollout_logp, mask, correction).items()},
    }


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
    """``loss_fn`` of :func:`moe_rl.models.forward.run_microbatches` for one step.

    ``num_tokens`` / ``num_seqs`` are the whole step's counts (of the tokens a rollout
    correction keeps), so micro-batch losses (and data-parallel ranks') sum to the full
    batch's loss; a micro-batch's ``correction`` weights its loss terms and drops tokens. Metrics per micro-batch: the
    loss's own (clip fraction, ratios, approx KL), ``pg_loss``, ``loss``, ``entropy``,
    ``kl_ref`` (with a reference), ``token_log_ratio`` and ``token_clipped``
    (``[b, s-1]``, for :meth:`RoutingMonitor.add_update_log_ratios`) with ``log_ratio_mask``
    (the tokens in the loss; :func:`log_ratio_metrics` adds ``log_ratio``, the masked token
    log-ratios for the histogram, and their 1st/99th percentiles after the pass), ``tokens``,
    and — when the old policy is this pass's own (on-policy) — the rollout log-prob mismatch
    of :func:`logprob_mismatch`. Nothing here reads a value back to the host.
    """

    algorithm: AlgorithmConfig
    num_tokens: float
    num_seqs: float

    def __call__(self, logp_entropy: Tensor, mb: PolicyMicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        a = self.algorithm
        logp, entropy = logp_entropy[..., 0], logp_entropy[..., 1]
        mask = mb.mask if mb.correction is None else mb.mask * mb.correction.keep  # dropped tokens leave every term
        old = mb.old_logp if mb.old_logp is not None else logp.detach()  # on-policy: the old policy is this one
        params = {**a.loss_params, "num_tokens": self.num_tokens, "num_seqs": self.num_seqs}
        if mb.correction is not None:
            params["token_weights"] = mb.correction.weights
        loss, metrics = policy_loss(a.loss, logp, old, mb.advantages, mask, **params)
        metrics = {k: v for k, v in metrics.items() if k != "dual_clip_frac"}
        metrics["pg_loss"] = loss.detach()
        agg = a.loss_params.get("agg") or "token-mean"
        common = dict(num_tokens=self.num_tokens, num_seqs=self.num_seqs)
        if a.kl_coef > 0:
            if mb.ref_logp is None:
                raise ValueError("a KL term needs the reference log-probs (compute_reference_logprobs)")
            kl = kl_penalty(logp, mb.ref_logp, mask, a.kl_estimator, agg, **common)
            loss = loss + a.kl_coef * kl
            metrics["kl_ref"] = kl.detach() * self.num_tokens / mask.sum().clamp(min=1.0)  # no host sync
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * entropy_bonus(entropy, mask, agg, **common)
        metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        # with token_clipped: split by routing change; with log_ratio_mask: log_ratio_metrics
        metrics["token_log_ratio"] = logp.detach() - old
        metrics["log_ratio_mask"] = mask
        if mb.old_logp is None:
            metrics.update(logprob_mismatch(logp, mb.rollout_logp, mask))
        metrics["loss"] = loss.detach()
        metrics["tokens"] = mask.sum()
        return loss, metrics


def log_ratio_metrics(outputs: list[dict]) -> None:
    """Adds to each micro-batch's metrics of an update pass its masked token log-ratios
    ``log_ratio`` (for the histogram) and their 1st/99th percentiles, for all micro-batches
    at once after the pass: one boolean selection and one device sync for the pass (inside
    the loss, each micro-batch's selection stalled the pass on a GPU)."""
    parts = [out for out in outputs if "token_log_ratio" in out and "log_ratio_mask" in out]
    if not parts:
        return
    keep = [out["log_ratio_mask"].bool() for out in parts]
    counts = torch.stack([k.sum() for k in keep]).tolist()
    selected = torch.cat([out["token_log_ratio"].reshape(-1) for out in parts])[
        torch.cat([k.reshape(-1) for k in keep])
    ]
    for out, values in zip(parts, selected.split(counts)):
        out["log_ratio"] = values
        if values.numel():
            # one sort for both (each value the same arithmetic as a call of its own)
            out["log_ratio_p01"], out["log_ratio_p99"] = torch.quantile(
                values.float(), _percentile_points(values.device)
            )


@functools.cache
def _percentile_points(device: torch.device) -> Tensor:
    """The 1st and 99th percentile points on ``device`` (copied there once, not a copy, and
    on a GPU a sync, per pass)."""
    return torch.tensor([0.01, 0.99], device=device)
