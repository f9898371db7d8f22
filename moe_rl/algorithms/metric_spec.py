"""The one specification of a training step's metrics: each metric's name and how its
per-micro-batch values reduce over micro-batches and data-parallel ranks, declared once
here. Losses and the objective write values under these names (scalars, on the rank's
device); :mod:`moe_rl.trainer.metrics` alone reduces them."""

from __future__ import annotations

import enum

from moe_rl.algorithms.rollout_correction import MISMATCH_SUMS


class Reduction(enum.Enum):
    """How a metric's values over micro-batches and ranks become the step's figure."""

    SUM = "sum"  # added up: loss terms (already normalised by the step's counts), counts, sums
    TOKEN_MEAN = "token_mean"  # each micro-batch's value weighted by its TOKENS, over all of them
    MIN = "min"
    MAX = "max"


TOKENS = "tokens"  # a micro-batch's tokens in the loss: the weight of its TOKEN_MEAN metrics
OFFPOLICY = "offpolicy/"  # prefix of the off-policy diagnostics' sums

# an update pass's metrics, per micro-batch
UPDATE_METRICS: dict[str, Reduction] = {
    # the objective's (moe_rl.trainer.objective)
    "loss": Reduction.SUM,
    "pg_loss": Reduction.SUM,
    "entropy": Reduction.TOKEN_MEAN,
    "kl_ref": Reduction.TOKEN_MEAN,
    TOKENS: Reduction.SUM,
    "log_ratio_p01": Reduction.TOKEN_MEAN,  # percentiles of the rank's token log-ratios (each micro-batch has the pass's)
    "log_ratio_p99": Reduction.TOKEN_MEAN,
    # every policy loss's (moe_rl.algorithms.losses)
    "clip_frac": Reduction.TOKEN_MEAN,
    "ratio_mean": Reduction.TOKEN_MEAN,
    "approx_kl": Reduction.TOKEN_MEAN,
    "ratio_min": Reduction.MIN,
    "ratio_max": Reduction.MAX,
    # one loss's own: grpo with dual_clip, sapo
    "dual_clip_frac": Reduction.TOKEN_MEAN,
    "gate_weight_mean": Reduction.TOKEN_MEAN,
}
# the update metrics logged (as train/<name>, in this order); the others are measured only
LOGGED_UPDATE_METRICS = (
    "loss",
    "pg_loss",
    "clip_frac",
    "ratio_mean",
    "approx_kl",
    "entropy",
    "kl_ref",
    "log_ratio_p01",
    "log_ratio_p99",
    "ratio_min",
    "ratio_max",
)
# a policy loss's per-token figures ([B, T]): never reduced, handed on to the routing monitor
LOSS_TOKEN_FIGURES = ("token_clipped",)

# the train-inference mismatch of a step's old log-probs, per micro-batch
# (moe_rl.trainer.rollout_mismatch); the logged figures are formed from the reduced sums
ROLLOUT_MISMATCH_METRICS: dict[str, Reduction] = {
    "mismatch_sum": Reduction.SUM,  # |trainer - rollout| log-prob over the response tokens
    "mismatch_tokens": Reduction.SUM,
    "mismatch_max": Reduction.MAX,
    **{OFFPOLICY + name: Reduction.SUM for name in MISMATCH_SUMS},
    OFFPOLICY + "weight_min": Reduction.MIN,
    OFFPOLICY + "weight_max": Reduction.MAX,
}
