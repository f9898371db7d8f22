"""Policy losses: GRPO/PPO token clip (DAPO clip-higher, dual clip), GSPO, GSPO-token,
GMPO (token clip in log space), its sequence-clip ablation, CISPO and
SAPO (a soft sigmoid gate instead of a clip, arXiv 2511.20347).

Each loss is a pure function of ``logp``, ``old_logp``, ``advantages`` (already expanded
to ``[B, T]``) and ``mask`` returning ``(loss_to_minimise, metrics)``. Every loss builds a
per-token loss ``[B, T]`` (sequence-level losses repeat their value over the sequence's
tokens) and reduces it with :func:`aggregate`, so all of them honour ``agg``,
``num_tokens`` and ``num_seqs`` and are exact under micro-batching.

Metrics (detached): ``clip_frac`` (share of response tokens whose objective is clipped)
and ``token_clipped`` (``[B, T]``: 1 where it is), ``ratio_mean/min/max`` (the importance ratio the loss uses: per token for
GRPO/CISPO, per sequence for GSPO and GMPO, its mean over response tokens either way) and ``approx_kl`` (k3 estimate of
KL(old || new) per token).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
from torch import Tensor

from moe_rl.algorithms.aggregation import (
    AGG_MODES,
    Count,
    aggregate,
    masked_mean,
    masked_min_max,
    sequence_mean,
)
from moe_rl.algorithms.registry import Registry

LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[LossFn] = Registry("policy loss")

# exp() of a log-ratio beyond this overflows float32 gradients; clamp before exp.
LOG_RATIO_LIMIT = 20.0


def policy_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **params,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss ``name`` on ``[B, T]`` log-probs; ``advantages`` is ``[B]`` or ``[B, T]``.

    Common params: ``agg`` and the global ``num_tokens`` / ``num_seqs`` of
    :func:`moe_rl.algorithms.aggregation.aggregate`, and ``token_weights`` (``[B, T]``,
    detached: a rollout correction's, multiplying each token's loss term before it is
    aggregated); others depend on the loss
    (see :func:`loss_defaults`). Unknown params raise ``ValueError``.
    """
    fn = POLICY_LOSSES.get(name)
    check_loss_params(name, params)
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp and mask must share one [B, T] shape; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages {tuple(advantages.shape)} do not match batch {logp.shape[0]}")
        advantages = advantages.unsqueeze(1).expand_as(logp)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T]; got {tuple(advantages.shape)}")
    elif name in SEQUENCE_ADVANTAGE_LOSSES:  # (a host read: [B] advantages, the trainer's, skip it)
        _check_one_advantage_per_sequence(name, advantages, mask)
    weights = params.get("token_weights")
    if weights is not None and weights.shape != logp.shape:
        raise ValueError(f"token_weights must be [B, T] like logp; got {tuple(weights.shape)}")
    # at least fp32: bf16's step near 1 (2^-8) is coarser than GSPO's clip band (3e-4)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    if weights is not None:
        params = {**params, "token_weights": weights.to(dtype)}
    adv = advantages.detach().to(dtype)
    # padding may hold anything (-inf log-probs from a library caller): 0 there, no gradient
    padding = mask == 0
    logp, old_logp = logp.to(dtype).masked_fill(padding, 0.0), old_logp.detach().to(dtype).masked_fill(padding, 0.0)
    return fn(logp, old_logp, adv, mask.to(dtype), **params)


def loss_defaults(name: str) -> dict[str, object]:
    """The parameters loss ``name`` accepts, with their defaults (``num_tokens`` and
    ``num_seqs`` included: the trainer passes those, a user does not)."""
    sig = inspect.signature(POLICY_LOSSES.get(name))
    return {k: p.default for k, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}


# set per batch by the caller, never by a user's config (token_weights: a rollout
# correction's per-token importance weights, :mod:`moe_rl.algorithms.rollout_correction`)
RUNTIME_PARAMS = ("num_tokens", "num_seqs", "token_weights")


def check_loss_params(name: str, params: dict, *, configurable_only: bool = False) -> None:
    """The one validator of loss parameters (the config's checks call it too). Raises
    ``ValueError`` whose message starts with the parameter's name, e.g.
    ``eps_low=1.5 is out of range; valid: 0 <= eps_low <= 1``."""
    valid = loss_defaults(name)
    settable = [k for k in valid if not (configurable_only and k in RUNTIME_PARAMS)]
    for key in params:
        if key not in settable:
            raise ValueError(f"{key} is not a parameter of loss {name!r}; valid: {', '.join(settable)}")
    for key, value in params.items():
        if key in ("agg", *RUNTIME_PARAMS) or (key == "dual_clip" and value is None):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key}={value!r} must be a finite number")
    agg = params.get("agg", valid["agg"])
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r} is not valid; valid: {', '.join(AGG_MODES)}")
    if "eps_low" in params and not 0.0 <= params["eps_low"] <= 1.0:
        raise ValueError(f"eps_low={params['eps_low']!r} is out of range; valid: 0 <= eps_low <= 1")
    if "eps_high" in params and not params["eps_high"] >= 0.0:
        raise ValueError(f"eps_high={params['eps_high']!r} is out of range; valid: eps_high >= 0")
    if params.get("dual_clip") is not None and params["dual_clip"] <= 1.0:
        raise ValueError(f"dual_clip={params['dual_clip']!r} must be > 1 (or null to disable)")
    if "log_clip" in params and params["log_clip"] <= 0.0:
        raise ValueError(f"log_clip={params['log_clip']!r} must be > 0")
    for key in ("tau_pos", "tau_neg"):
        if key in params and params[key] <= 0.0:
            raise ValueError(f"{key}={params[key]!r} must be > 0")


# ---------------------------------------------------------------- shared pieces


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO's ``max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))`` and where the clip is active."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


# losses that weigh a whole sequence by one advantage
SEQUENCE_ADVANTAGE_LOSSES = frozenset({"gspo", "gmpo", "gmpo_seqclip"})


def _check_one_advantage_per_sequence(name: str, adv: Tensor, mask: Tensor) -> None:
    """``ValueError`` where ``[B, T]`` advantages vary within a sequence's masked tokens."""
    dtype = torch.promote_types(adv.dtype, torch.float32)
    adv, mask = adv.detach().to(dtype), mask.to(dtype)
    seq_adv = sequence_mean(adv, mask)
    spread = ((adv - seq_adv.unsqueeze(1)).abs() * mask).amax() if adv.numel() else adv.new_zeros(())
    if spread > 1e-6 * (1.0 + seq_adv.abs().max()):
        raise ValueError(
            f"policy loss {name!r} needs one advantage per sequence, but the per-token "
            "advantages vary within a sequence (use 'gspo_token' for token-level advantages)"
        )


def _per_sequence_advantage(adv: Tensor, mask: Tensor) -> Tensor:
    """The one advantage of each sequence (:func:`policy_loss` has checked there is one)."""
    return sequence_mean(adv, mask)


def _token_kl(log_ratio: Tensor) -> Tensor:
    """k3 estimate of KL(old || new) per token: ``(rho - 1) - log rho``."""
    lr = log_ratio.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.expm1(lr) - lr


def _metrics(
    mask: Tensor, log_ratio: Tensor, clipped: Tensor, ratio: Tensor, ratio_mask: Tensor, **extra: Tensor
) -> dict[str, Tensor]:
    rmin, rmax = masked_min_max(ratio, ratio_mask)
    out = {
        "clip_frac": masked_mean(clipped.to(mask.dtype), mask).detach(),
        "token_clipped": clipped.to(mask.dtype).detach(),
        "ratio_mean": masked_mean(ratio.detach(), ratio_mask).detach(),
        "ratio_min": rmin,
        "ratio_max": rmax,
        "approx_kl": masked_mean(_token_kl(log_ratio), mask).detach(),
    }
    out.update({k: v.detach() for k, v in extra.items()})
    return out


def _reduce(
    per_token: Tensor, mask: Tensor, agg: str, num_tokens: Count, num_seqs: Count, token_weights: Tensor | None
) -> Tensor:
    if token_weights is not None:  # a rollout correction's importance weights (detached)
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    return aggregate(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)


# ---------------------------------------------------------------- the losses


@POLICY_LOSSES.register("grpo")
def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO token clip; ``eps_high > eps_low`` is DAPO clip-higher; ``dual_clip`` caps
    the loss of negative-advantage tokens at ``-A * dual_clip``."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    per_token, clipped = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    loss = _reduce(per_token, mask, agg, num_tokens, num_seqs, token_weights)
    metrics = _metrics(
        mask, log_ratio, clipped | dual, ratio, mask, dual_clip_frac=masked_mean(dual.to(mask.dtype), mask)
    )
    return loss, metrics


def _on_tokens(seq_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """A sequence-level ratio ``[B]`` as each response token's ``[B, T]``, for the metrics:
    its mean is then token-weighted, as the trainer weighs micro-batches (a mean over each
    micro-batch's sequences would depend on how the batch is split)."""
    return seq_ratio.unsqueeze(1).expand_as(mask), mask


def _ratio_mask(mask: Tensor, token_weights: Tensor | None) -> Tensor:
    """The tokens a sequence-level ratio is taken over: ``mask`` less the tokens a correction
    weighted 0 (IcePop's, a rejected sequence's), which would otherwise still set the ratio,
    its clip, and get a gradient through it."""
    return mask if token_weights is None else mask * (token_weights != 0).to(mask.dtype)


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: clip the length-normalised sequence ratio ``s_i = exp(mean_t logr)``."""
    seq_adv = _per_sequence_advantage(adv, mask)
    log_ratio = logp - old_logp
    in_ratio = _ratio_mask(mask, token_weights)
    seq_ratio = torch.exp(sequence_mean(log_ratio, in_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    per_seq, clipped = _clipped_surrogate(seq_ratio, seq_adv, eps_low, eps_high)
    per_token = per_seq.unsqueeze(1).expand_as(logp)
    loss = _reduce(per_token, mask, agg, num_tokens, num_seqs, token_weights)
    return loss, _metrics(mask, log_ratio, clipped.unsqueeze(1).expand_as(mask), *_on_tokens(seq_ratio, mask))


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: ``s_{i,t} = sg[s_i] * pi(o_t) / sg[pi(o_t)]``, token advantages allowed."""
    log_ratio = logp - old_logp
    in_ratio = _ratio_mask(mask, token_weights)
    seq_ratio = torch.exp(sequence_mean(log_ratio, in_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).detach()
    token_ratio = seq_ratio.unsqueeze(1) * torch.exp(logp - logp.detach())
    per_token, clipped = _clipped_surrogate(token_ratio, adv, eps_low, eps_high)
    loss = _reduce(per_token, mask, agg, num_tokens, num_seqs, token_weights)
    return loss, _metrics(mask, log_ratio, clipped, *_on_tokens(seq_ratio, mask))


@POLICY_LOSSES.register("gmpo")
def gmpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    log_clip: float = 0.4,
    agg: str = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: geometric mean of token ratios, each clipped in log space at ``±log_clip``
    on the side the advantage's sign makes optimistic; loss ``-A_i * ratio_i``."""
    seq_adv = _per_sequence_advantage(adv, mask)
    sign = torch.sign(seq_adv).unsqueeze(1)
    log_ratio = logp - old_logp
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-log_clip, log_clip))
    in_ratio = _ratio_mask(mask, token_weights)
    geo_ratio = torch.exp(sequence_mean(clipped_log_ratio, in_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    per_token = (-seq_adv * geo_ratio).unsqueeze(1).expand_as(logp)
    loss = _reduce(per_token, mask, agg, num_tokens, num_seqs, token_weights)
    clipped = (sign * log_ratio) > log_clip
    return loss, _metrics(mask, log_ratio, clipped, *_on_tokens(geo_ratio, mask))


@POLICY_LOSSES.register("gmpo_seqclip")
def gmpo_seqclip_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    log_clip: float = 0.4,
    agg: str = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO ablation with a sequence-level clip (as DeepSeek-R1): the log of the whole
    product ``sum_t logr`` is clipped at ``±log_clip``, then its geometric mean taken."""
    seq_adv = _per_sequence_advantage(adv, mask)
    sign = torch.sign(seq_adv)
    log_ratio = logp - old_logp
    in_ratio = _ratio_mask(mask, token_weights)
    log_prod = (log_ratio * in_ratio).sum(-1)
    clipped_log_prod = sign * torch.minimum(sign * log_prod, sign * log_prod.clamp(-log_clip, log_clip))
    seq_len = in_ratio.sum(-1).clamp(min=1)
    geo_ratio = torch.exp((clipped_log_prod / seq_len).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    per_token = (-seq_adv * geo_ratio).unsqueeze(1).expand_as(logp)
    loss = _reduce(per_token, mask, agg, num_tokens, num_seqs, token_weights)
    clipped = ((sign * log_prod) > log_clip).unsqueeze(1).expand_as(mask)
    return loss, _metrics(mask, log_ratio, clipped, *_on_tokens(geo_ratio, mask))


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    agg: str = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): REINFORCE with a clipped, stop-gradient importance weight,
    ``-sg[clip(rho, 1-eps_low, 1+eps_high)] * A * logp``; no token's gradient is dropped."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = -weight * adv * logp
    loss = _reduce(per_token, mask, agg, num_tokens, num_seqs, token_weights)
    clipped = weight != ratio.detach()
    return loss, _metrics(mask, log_ratio, clipped, ratio, mask)


@POLICY_LOSSES.register("sapo")
def sapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg: str = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, for MoE stability): each token's ratio through a soft gate,
    ``-A * (4 / tau) * sigmoid(tau * (r - 1))`` with ``tau = tau_pos`` where ``A > 0`` and
    ``tau_neg`` elsewhere. Its gradient weight ``4 s (1 - s)`` (``s`` the sigmoid) is 1 at
    ``r = 1`` (the policy gradient) and decays smoothly as the token goes off-policy;
    ``tau_neg > tau_pos`` damps negative-advantage tokens sooner. ``clip_frac``: tokens
    whose gradient weight is below one half."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    tau = torch.full_like(adv, tau_neg).masked_fill(adv > 0, tau_pos)  # filled on the device: no host copy
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -adv * (4.0 / tau) * gate
    loss = _reduce(per_token, mask, agg, num_tokens, num_seqs, token_weights)
    grad_weight = (4.0 * gate * (1.0 - gate)).detach()
    return loss, _metrics(
        mask, log_ratio, grad_weight < 0.5, ratio, mask, gate_weight_mean=masked_mean(grad_weight, mask)
    )
