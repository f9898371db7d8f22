"""KL-to-reference estimators (k1, k2, k3) and the entropy term."""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.algorithms.aggregation import Count, aggregate
from moe_rl.algorithms.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")
_LOG_RATIO_LIMIT = 20.0


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``log pi_ref - log pi`` in at least fp32 (bf16 log-probs near 0 differ by its ulps)."""
    dtype = torch.promote_types(torch.promote_types(logp.dtype, ref_logp.dtype), torch.float32)
    return ref_logp.to(dtype) - logp.to(dtype)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``log pi - log pi_ref`` (unbiased, high variance, can be negative)."""
    return -_log_ratio(logp, ref_logp)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``0.5 * (log pi - log pi_ref)^2``."""
    return 0.5 * _log_ratio(logp, ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor, clamp: float = 10.0) -> Tensor:
    """``exp(d) - d - 1`` with ``d = log pi_ref - log pi`` (low variance, >= 0), clamped;
    as ``expm1(d) - d``: within two roundings of ``d`` (``exp(d) - 1 - d``: of 1, which
    is all of it, and negative, at ``|d|`` ~ 1e-4 in fp32)."""
    d = _log_ratio(logp, ref_logp).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return (torch.expm1(d) - d).clamp(min=0.0, max=clamp)


def kl_divergence(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL(pi || pi_ref) estimate ``[B, T]`` by estimator ``kind``."""
    return KL_ESTIMATORS.get(kind)(logp, ref_logp)


def kl_penalty(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kind: str = "k3",
    agg: str = "token-mean",
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
) -> Tensor:
    """Aggregated KL to the reference policy, to add (times a coefficient) to the loss."""
    return aggregate(kl_divergence(logp, ref_logp, kind), mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``-sum p log p``, in at least fp32;
    a ``-inf`` logit (a masked-out token) has ``p = 0`` and adds 0, not ``0 * -inf = NaN``."""
    logp = torch.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
) -> Tensor:
    """Aggregated entropy; subtract ``coef *`` this from the loss to encourage exploration."""
    return aggregate(entropy, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
