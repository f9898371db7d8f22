"""Routing drift between two routings of the same tokens (docs/routing.md).

A routing is the top-k expert indices ``[T, L, k]`` (tokens x MoE layers x k), and
optionally the router's distribution over experts ``[T, L, E]`` (for ``router_kl``).
Per-layer metrics are ``[L]`` tensors; ``mask`` ``[T]`` selects the tokens that count.
All are vectorised and cheap enough to run every training step.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _token_weights(a: Tensor, mask: Tensor | None) -> Tensor:
    w = torch.ones(a.shape[0], dtype=torch.float64, device=a.device) if mask is None else mask.to(torch.float64)
    if w.shape != (a.shape[0],):
        raise ValueError(f"mask must be [T]={a.shape[0]}, got {tuple(w.shape)}")
    return w


def _check_pair(a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape or a.dim() != 3:
        raise ValueError(f"routings must both be [T, L, k]; got {tuple(a.shape)} and {tuple(b.shape)}")


def _masked_token_mean(values: Tensor, w: Tensor) -> Tensor:
    """Mean over tokens of ``values`` ``[T, ...]`` weighted by ``w`` ``[T]``."""
    shape = (-1,) + (1,) * (values.dim() - 1)
    return (values.to(torch.float64) * w.view(shape)).sum(0) / w.sum().clamp(min=1)


def overlap(a: Tensor, b: Tensor) -> Tensor:
    """``|S_a ∩ S_b|`` per token and layer ``[T, L]``."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)


def changed_frac(a: Tensor, b: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per layer: the fraction of tokens whose top-k set differs."""
    _check_pair(a, b)
    changed = overlap(a, b) < a.shape[-1]
    return _masked_token_mean(changed, _token_weights(a, mask))


def expert_change_frac(a: Tensor, b: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per layer: the mean of ``1 - |S_a ∩ S_b| / k`` (share of activated experts changed)."""
    _check_pair(a, b)
    changed = 1.0 - overlap(a, b).to(torch.float64) / a.shape[-1]
    return _masked_token_mean(changed, _token_weights(a, mask))


def any_layer_changed_frac(a: Tensor, b: Tensor, mask: Tensor | None = None) -> Tensor:
    """The fraction of tokens whose set differs in at least one layer (a scalar)."""
    _check_pair(a, b)
    changed = (overlap(a, b) < a.shape[-1]).any(-1)
    return _masked_token_mean(changed, _token_weights(a, mask))


def router_kl(p_a: Tensor, p_b: Tensor, mask: Tensor | None = None, eps: float = 1e-12) -> Tensor:
    """Per layer: mean over tokens of KL(p_a || p_b) between router distributions ``[T, L, E]``."""
    if p_a.shape != p_b.shape or p_a.dim() != 3:
        raise ValueError(f"router distributions must both be [T, L, E]; got {tuple(p_a.shape)}, {tuple(p_b.shape)}")
    pa, pb = p_a.to(torch.float64).clamp(min=eps), p_b.to(torch.float64).clamp(min=eps)
    kl = (pa * (pa.log() - pb.log())).sum(-1)
    return _masked_token_mean(kl, _token_weights(p_a, mask))


def expert_load(indices: Tensor, num_experts: int, mask: Tensor | None = None) -> Tensor:
    """Tokens routed to each expert ``[L, E]`` (a token counts once per chosen expert)."""
    t, l, k = indices.shape
    w = _token_weights(indices, mask)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_experts):  # (uint8 holds no 256)
        raise ValueError(f"expert indices out of range [0, {num_experts})")
    offsets = (torch.arange(l, device=indices.device) * num_experts).view(1, l, 1)
    flat = (indices.long() + offsets).reshape(-1)
    weights = w.view(t, 1, 1).expand(t, l, k).reshape(-1)
    return torch.bincount(flat, weights=weights, minlength=l * num_experts).view(l, num_experts)


def load_cv(load: Tensor) -> Tensor:
    """Coefficient of variation of each layer's expert load ``[L]`` (0 = perfectly even)."""
    mean = load.mean(-1)
    return load.std(-1, unbiased=False) / mean.clamp(min=1e-12)


def load_entropy(load: Tensor) -> Tensor:
    """Entropy (nats) of each layer's load distribution ``[L]``; ``log E`` = perfectly even."""
    p = load / load.sum(-1, keepdim=True).clamp(min=1e-12)
    return -(p * p.clamp(min=1e-12).log()).sum(-1)


def drift_metrics(
    a: Tensor,
    b: Tensor,
    *,
    probs_a: Tensor | None = None,
    probs_b: Tensor | None = None,
    mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Every drift metric: ``[L]`` per-layer values (``any_layer_changed_frac``: scalar);
    ``router_kl`` only when both distributions are given."""
    out = {
        "changed_frac": changed_frac(a, b, mask),
        "expert_change_frac": expert_change_frac(a, b, mask),
        "any_layer_changed_frac": any_layer_changed_frac(a, b, mask),
    }
    if probs_a is not None and probs_b is not None:
        out["router_kl"] = router_kl(probs_a, probs_b, mask)
    return out


def load_metrics(indices: Tensor, num_experts: int, mask: Tensor | None = None) -> dict[str, Tensor]:
    """Per-layer expert load ``[L, E]`` with its CV and entropy ``[L]``."""
    load = expert_load(indices, num_experts, mask)
    return {"expert_load": load, "expert_load_cv": load_cv(load), "expert_load_entropy": load_entropy(load)}


def summarize(metrics: dict[str, Tensor]) -> dict[str, dict]:
    """JSON-ready ``{metric: {"layers": [...], "mean": x}}`` (scalars: ``{"mean": x}``)."""
    out: dict[str, dict] = {}
    for name, value in metrics.items():
        if name == "expert_load":
            out[name] = {"layers": value.tolist()}
        elif value.dim() == 0:
            out[name] = {"mean": float(value)}
        else:
            out[name] = {"layers": [float(x) for x in value], "mean": float(value.mean())}
    return out
