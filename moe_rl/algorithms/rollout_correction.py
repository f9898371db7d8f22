"""Train-inference mismatch correction: importance weights between the trainer's old
log-probs and the rollout engine's, truncated, masked or used to reject samples.

Each correction is a pure function of ``old_logp`` (the trainer's recomputed log-probs of
the sampled tokens), ``rollout_logp`` (the engine's) and ``mask`` (``[B, T]`` each),
returning a :class:`Correction`: detached per-token ``weights`` the policy loss's per-token
terms are multiplied by, and ``keep`` (``[B, T]``, 0/1): the tokens left in the loss.
Dropped tokens (``keep`` 0) also leave the loss's normaliser (the trainer counts kept
tokens and sequences over the whole step); a token kept with weight 0 (IcePop's) gives no
policy gradient but still counts in the normaliser.

With ``r_t = pi_train(o_t) / pi_rollout(o_t)`` (``log r = old_logp - rollout_logp``):

- ``token_tis``: ``w_t = min(r_t, upper)`` (truncated IS, slime/Miles ``--use-tis``);
- ``seq_tis``: ``w_i = min(R_i, upper)`` with ``R_i = exp(sum_t log r)`` (``seq_ratio="sum"``)
  or its geometric mean ``exp(mean_t log r)`` (``"mean"``), on every token of the sequence;
- ``token_mis``: tokens with ``r_t`` outside ``[lower, upper]`` are dropped, the rest
  weighted by ``r_t`` (masked IS);
- ``icepop``: IcePop (Ring-1T, arXiv 2510.18855): ``w_t = r_t`` inside ``[lower, upper]``
  and 0 outside, every token kept in the normaliser;
- ``token_band_reject``: tokens with ``r_t`` outside ``[lower, upper]`` dropped, the rest
  unweighted (token-level rejection sampling);
- ``seq_mis``: sequences with ``R_i`` outside ``[lower, upper]`` dropped, the rest weighted
  by ``R_i``;
- ``reject``: sequences whose divergence ``seq_agg`` (mean | sum | max) over tokens of the
  per-token ``estimator`` (k1 | k2 | k3 of KL(rollout || trainer)) exceeds ``threshold``
  are dropped, the rest unweighted.

Only what goes into ``exp()`` is clamped to ``+-LOG_RATIO_LIMIT``: a token's ``log r``
before its ratio or k3, a sequence's sum (or mean) of the unclamped ``log r`` before
``R_i``; k1 and k2 use ``log r`` as it is.

``old_logprobs=rollout`` needs none of these: the policy ratio is then taken against the
engine's log-probs, which folds the weight into it (verl's "bypass" mode).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from moe_rl.algorithms.registry import Registry

LOG_RATIO_LIMIT = 20.0  # exp() beyond this overflows float32
SEQ_RATIOS = ("sum", "mean")
DIVERGENCES = ("k1", "k2", "k3")
SEQ_AGGS = ("mean", "sum", "max")


@dataclass(frozen=True)
class Correction:
    """``weights`` (detached, 1 where nothing is corrected) and ``keep`` (1 = in the loss),
    ``[B, T]`` each and 0 off the response; ``truncated``: 1 where a weight was capped."""

    weights: Tensor
    keep: Tensor
    truncated: Tensor


CorrectionFn = Callable[..., Correction]
ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")


def rollout_correction(name: str, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, **params) -> Correction:
    """Correction ``name`` (see the module docstring) with its ``params``; unknown or
    out-of-range params raise ``ValueError``."""
    fn = ROLLOUT_CORRECTIONS.get(name)
    check_correction_params(name, params)
    if old_logp.shape != rollout_logp.shape or mask.shape != old_logp.shape or old_logp.dim() != 2:
        raise ValueError(
            f"old_logp, rollout_logp and mask must share one [B, T] shape; got "
            f"{tuple(old_logp.shape)}, {tuple(rollout_logp.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(old_logp.dtype)
    out = fn(_masked_log_ratio(old_logp, rollout_logp, m), m, **params)
    return Correction(out.weights.detach() * m, out.keep * m, out.truncated * m)


def _on_mask(x: Tensor, m: Tensor) -> Tensor:
    """``x * m``, 0 on padding whatever ``x`` holds there (``-inf * 0`` is NaN)."""
    return torch.where(m != 0, x, 0.0) * m


def _masked_log_ratio(old_logp: Tensor, rollout_logp: Tensor, m: Tensor) -> Tensor:
    """``old - rollout`` on the mask, 0 on padding."""
    return _on_mask(old_logp.detach() - rollout_logp.detach(), m)


def correction_defaults(name: str) -> dict[str, object]:
    sig = inspect.signature(ROLLOUT_CORRECTIONS.get(name))
    return {k: p.default for k, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}


def check_correction_params(name: str, params: dict) -> None:
    """The one validator (the config calls it too); messages start with the parameter."""
    valid = correction_defaults(name)
    for key in params:
        if key not in valid:
            raise ValueError(
                f"{key} is not a parameter of rollout correction {name!r}; valid: {', '.join(valid) or 'none'}"
            )
    merged = {**valid, **params}
    choices = {"seq_ratio": SEQ_RATIOS, "estimator": DIVERGENCES, "seq_agg": SEQ_AGGS}
    for key, value in merged.items():
        if key in choices:
            if value not in choices[key]:
                raise ValueError(f"{key}={value!r} is not valid; valid: {', '.join(choices[key])}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{key}={value!r} must be a finite number >= 0")
    if "lower" in merged and not merged["lower"] < merged["upper"]:
        raise ValueError(f"lower={merged['lower']!r} must be below upper={merged['upper']!r}")
    if "upper" in merged and not merged["upper"] > 0:
        raise ValueError(f"upper={merged['upper']!r} must be > 0")


def _token_ratio(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor, seq_ratio: str) -> Tensor:
    """Each row's sum (or mean) of the unclamped token log-ratios, then clamped for ``exp()``."""
    total = (log_ratio * mask).sum(-1)
    if seq_ratio == "mean":
        total = total / mask.sum(-1).clamp(min=1)
    return total.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def token_divergence(log_ratio: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(rollout || trainer) from samples of the rollout policy,
    ``log r = log pi_train - log pi_rollout``: k1 ``-log r``, k2 ``(log r)^2 / 2``, k3
    ``r - 1 - log r`` (of ``log r`` at most ``LOG_RATIO_LIMIT``: finite, and growing with it)."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    capped = log_ratio.clamp(max=LOG_RATIO_LIMIT)
    return torch.expm1(capped) - capped


def _untouched(mask: Tensor) -> Tensor:
    return torch.zeros_like(mask)


@ROLLOUT_CORRECTIONS.register("token_tis")
def token_tis(log_ratio: Tensor, mask: Tensor, *, upper: float = 2.0) -> Correction:
    ratio = _token_ratio(log_ratio)
    return Correction(ratio.clamp(max=upper), torch.ones_like(mask), (ratio > upper).to(mask.dtype))


@ROLLOUT_CORRECTIONS.register("seq_tis")
def seq_tis(log_ratio: Tensor, mask: Tensor, *, upper: float = 2.0, seq_ratio: str = "sum") -> Correction:
    ratio = _sequence_log_ratio(log_ratio, mask, seq_ratio).exp().unsqueeze(1).expand_as(mask)
    return Correction(ratio.clamp(max=upper), torch.ones_like(mask), (ratio > upper).to(mask.dtype))


def _in_band(ratio: Tensor, lower: float, upper: float) -> Tensor:
    return ((ratio >= lower) & (ratio <= upper)).to(ratio.dtype)


@ROLLOUT_CORRECTIONS.register("token_mis")
def token_mis(log_ratio: Tensor, mask: Tensor, *, lower: float = 0.5, upper: float = 2.0) -> Correction:
    ratio = _token_ratio(log_ratio)
    keep = _in_band(ratio, lower, upper)
    return Correction(ratio * keep, keep, _untouched(mask))


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(log_ratio: Tensor, mask: Tensor, *, lower: float = 0.5, upper: float = 2.0) -> Correction:
    """IcePop's ``M(k) = k`` inside ``[lower, upper]``, 0 outside; no token leaves the normaliser."""
    ratio = _token_ratio(log_ratio)
    return Correction(ratio * _in_band(ratio, lower, upper), torch.ones_like(mask), _untouched(mask))


@ROLLOUT_CORRECTIONS.register("token_band_reject")
def token_band_reject(log_ratio: Tensor, mask: Tensor, *, lower: float = 0.5, upper: float = 2.0) -> Correction:
    keep = _in_band(_token_ratio(log_ratio), lower, upper)
    return Correction(keep.clone(), keep, _untouched(mask))


@ROLLOUT_CORRECTIONS.register("seq_mis")
def seq_mis(
    log_ratio: Tensor, mask: Tensor, *, lower: float = 0.5, upper: float = 2.0, seq_ratio: str = "sum"
) -> Correction:
    ratio = _sequence_log_ratio(log_ratio, mask, seq_ratio).exp()
    keep = _in_band(ratio, lower, upper).unsqueeze(1).expand_as(mask)
    return Correction(ratio.unsqueeze(1) * keep, keep, _untouched(mask))


@ROLLOUT_CORRECTIONS.register("reject")
def reject(
    log_ratio: Tensor, mask: Tensor, *, threshold: float = 0.01, estimator: str = "k3", seq_agg: str = "max"
) -> Correction:
    per_token = token_divergence(log_ratio, estimator) * mask
    if seq_agg == "max":
        per_seq = per_token.masked_fill(mask == 0, float("-inf")).amax(-1).clamp(min=0)
    else:
        per_seq = per_token.sum(-1)
        if seq_agg == "mean":
            per_seq = per_seq / mask.sum(-1).clamp(min=1)
    keep = (per_seq <= threshold).to(mask.dtype).unsqueeze(1).expand_as(mask)
    return Correction(keep.clone(), keep, _untouched(mask))


# sums a step's diagnostics add over micro-batches and ranks; MIN/MAX ones take extremes
MISMATCH_SUMS = (
    "tokens",
    "seqs",
    "k1",
    "k3",
    "train_nll",
    "rollout_nll",
    "chi2_token",
    "chi2_seq",
    "weight",
    "weight_sq",
    "weighted_tokens",
    "truncated",
    "dropped_tokens",
    "dropped_seqs",
    "extreme_tokens",
)
EXTREME_LOG_RATIO = math.log(2.0)  # a token ratio outside [1/2, 2] counts as extreme (R3 paper, Fig. 1)


def mismatch_sums(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, correction: Correction | None = None
) -> dict[str, Tensor]:
    """Off-policy diagnostics of one micro-batch as sums (``MISMATCH_SUMS``) plus the
    weights' ``weight_min`` / ``weight_max``: KL(rollout || trainer) by k1 and k3, both
    sides' negative log-likelihoods (perplexities), chi-squared of the token and sequence
    ratios, the IS weights over the tokens in the policy gradient (kept with a nonzero
    weight: the correction's, else the raw token ratio) and how many tokens were truncated,
    how many left the gradient (dropped, or weighted 0 as IcePop's) and sequences left
    without any."""
    m = mask.to(torch.float64)
    log_ratio = _masked_log_ratio(old_logp.to(torch.float64), rollout_logp.to(torch.float64), m)
    seq_log_ratio = _sequence_log_ratio(log_ratio, m, "sum")
    has_tokens = (m.sum(-1) > 0).to(torch.float64)
    if correction is None:
        weights, keep, truncated = _token_ratio(log_ratio) * m, m, torch.zeros_like(m)
    else:
        weights, keep, truncated = (
            correction.weights.to(torch.float64),
            correction.keep.to(torch.float64),
            correction.truncated.to(torch.float64),
        )
    in_gradient = keep * (weights != 0).to(torch.float64)
    counted = in_gradient > 0  # (no boolean indexing: no host sync on a GPU)
    return {
        "tokens": m.sum(),
        "seqs": has_tokens.sum(),
        "k1": (token_divergence(log_ratio, "k1") * m).sum(),
        "k3": (token_divergence(log_ratio, "k3") * m).sum(),
        "train_nll": -_on_mask(old_logp.detach().to(torch.float64), m).sum(),
        "rollout_nll": -_on_mask(rollout_logp.detach().to(torch.float64), m).sum(),
        "chi2_token": ((torch.expm1(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)) ** 2) * m).sum(),
        "chi2_seq": ((torch.expm1(seq_log_ratio) ** 2) * has_tokens).sum(),
        "weight": (weights * in_gradient).sum(),
        "weight_sq": (weights**2 * in_gradient).sum(),
        "weighted_tokens": in_gradient.sum(),
        "truncated": truncated.sum(),
        "dropped_tokens": (m - in_gradient).sum(),
        "dropped_seqs": (has_tokens * (in_gradient.sum(-1) == 0).to(torch.float64)).sum(),
        "extreme_tokens": ((log_ratio.abs() > EXTREME_LOG_RATIO).to(torch.float64) * m).sum(),
        "weight_min": weights.masked_fill(~counted, math.inf).amin() if weights.numel() else m.new_tensor(math.inf),
        "weight_max": weights.masked_fill(~counted, -math.inf).amax() if weights.numel() else m.new_tensor(-math.inf),
    }


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's diagnostics from summed :func:`mismatch_sums` (over micro-batches and
    ranks): means per token / sequence, perplexities, the weights' effective sample size
    ``(sum w)^2 / (n sum w^2)`` (1 = all equal), the truncated / dropped fractions, and the
    share of tokens whose raw train/rollout ratio is outside [1/2, 2] (with or without a correction)."""
    tokens, seqs, kept = max(sums["tokens"], 1.0), max(sums["seqs"], 1.0), max(sums["weighted_tokens"], 1.0)
    train_ppl, rollout_ppl = (
        math.exp(min(sums["train_nll"] / tokens, 50.0)),
        math.exp(min(sums["rollout_nll"] / tokens, 50.0)),
    )
    return {
        "kl_k1": sums["k1"] / tokens,
        "kl_k3": sums["k3"] / tokens,
        "ppl_train": train_ppl,
        "ppl_rollout": rollout_ppl,
        "log_ppl_ratio": math.log(train_ppl) - math.log(rollout_ppl),
        "chi2_token": sums["chi2_token"] / tokens,
        "chi2_seq": sums["chi2_seq"] / seqs,
        "is_weight_mean": sums["weight"] / kept,
        "is_weight_min": sums["weight_min"] if math.isfinite(sums["weight_min"]) else 0.0,
        "is_weight_max": sums["weight_max"] if math.isfinite(sums["weight_max"]) else 0.0,
        "is_ess": sums["weight"] ** 2 / (kept * sums["weight_sq"]) if sums["weight_sq"] > 0 else 0.0,
        "truncated_frac": sums["truncated"] / tokens,
        "dropped_token_frac": sums["dropped_tokens"] / tokens,
        "rejected_seq_frac": sums["dropped_seqs"] / seqs,
        "extreme_token_frac": sums["extreme_tokens"] / tokens,
    }
