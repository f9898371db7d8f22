"""The train-inference mismatch of a step, measured in one place and at one stage: after
the updates, the old policy's log-probs against the rollout engine's. The old policy's
log-probs are the old-policy pass's, or on-policy (no such pass) the update pass's own:
the same source each figure had before it was measured here, so the figures are the
same to the last bit."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from moe_rl.algorithms.metric_spec import OFFPOLICY
from moe_rl.algorithms.rollout_correction import Correction, mismatch_sums
from moe_rl.routing.monitor import RoutingMonitor
from moe_rl.trainer.batch import PolicyMicroBatch


def logprob_mismatch(
    logp: Tensor, rollout_logp: Tensor, mask: Tensor, correction: Correction | None = None
) -> dict[str, Tensor]:
    """``|trainer log-prob - rollout log-prob|`` over response tokens: its sum, max and
    token count (reduced over micro-batches and ranks into a mean and a max), and the
    off-policy diagnostics' sums (:func:`moe_rl.algorithms.rollout_correction.mismatch_sums`,
    keys prefixed ``offpolicy/``) under ``correction`` if there is one: the values of
    :data:`moe_rl.algorithms.metric_spec.ROLLOUT_MISMATCH_METRICS`."""
    diff = (logp.detach() - rollout_logp).abs() * mask
    return {
        "mismatch_sum": diff.sum(),
        "mismatch_max": diff.max() if diff.numel() else diff.new_zeros(()),
        "mismatch_tokens": mask.sum(),
        **{OFFPOLICY + k: v for k, v in mismatch_sums(logp, rollout_logp, mask, correction).items()},
    }


def measure_rollout_mismatch(
    old_logprobs: Sequence[Tensor], batches: Sequence[PolicyMicroBatch], monitor: RoutingMonitor | None
) -> list[dict[str, Tensor]]:
    """Every rank calls it (``old_logprobs`` ``[b, s-1]`` per micro-batch; none off the last
    pipeline stage). The mismatch values of each micro-batch (under its rollout correction,
    if any) and, with a ``monitor``, its per-token mismatch split by routing change."""
    if monitor is not None:
        monitor.add_rollout_logp_mismatch(list(old_logprobs) or None, batches)
    return [logprob_mismatch(lp, mb.rollout_logp, mb.mask, mb.correction) for lp, mb in zip(old_logprobs, batches)]
