"""Advantage estimators: GRPO, Dr.GRPO, RLOO and GDPO.

Every estimator takes rewards ``[B, n_rewards]`` with the ``group_size`` samples of one
prompt contiguous, reward weights ``[n_rewards]`` and returns one advantage per sample.
Statistics are taken within each group; std is the sample std (Bessel-corrected, as
``torch.std``). A group whose values are all equal gets advantage 0, never NaN.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.algorithms.registry import Registry

AdvantageFn = Callable[..., Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_size: int,
    *,
    weights: Sequence[float] | Tensor | None = None,
    eps: float = 1e-6,
    process_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Advantages ``[B]`` for rewards ``[B]`` or ``[B, n_rewards]``.

    ``weights`` weigh the reward columns (default: all 1). ``process_group`` is only
    used by estimators with batch-level statistics (``gdpo``): pass the data-parallel
    group so the batch mean/std span every rank's samples.
    """
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    r = _as_reward_matrix(rewards)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if r.shape[0] % group_size != 0:
        raise ValueError(f"batch of {r.shape[0]} rewards is not a whole number of groups of {group_size}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    w = _as_weights(weights, r.shape[1], r)
    return estimator(r, group_size, w, eps, process_group)


def _as_reward_matrix(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor):
        rewards = torch.as_tensor(rewards)
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    if rewards.dim() != 2 or rewards.shape[0] == 0:
        raise ValueError(f"rewards must be [B] or [B, n_rewards] with B > 0, got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or Inf; score failed rewards as 0 before this")
    return rewards


def _as_weights(weights: Sequence[float] | Tensor | None, n: int, like: Tensor) -> Tensor:
    if weights is None:
        return torch.ones(n, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device).flatten()
    if w.numel() != n:
        raise ValueError(f"got {w.numel()} reward weights for {n} reward columns")
    return w


def _group_centered(x: Tensor, group_size: int, scale: bool, eps: float) -> Tensor:
    """``(x - mean_g) [/ (std_g + eps)]`` per group; constant groups give exactly 0."""
    if group_size == 1:
        return torch.zeros_like(x)
    g = x.view(-1, group_size, *x.shape[1:])
    centered = g - g.mean(dim=1, keepdim=True)
    if scale:
        centered = centered / (g.std(dim=1, keepdim=True) + eps)
    constant = g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)
    return centered.masked_fill(constant, 0.0).view_as(x)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(r: Tensor, group_size: int, w: Tensor, eps: float, _group=None) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` of the weighted reward sum."""
    return _group_centered(r @ w, group_size, scale=True, eps=eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(r: Tensor, group_size: int, w: Tensor, eps: float, _group=None) -> Tensor:
    """``r - mean_g`` (Dr.GRPO drops the std division)."""
    return _group_centered(r @ w, group_size, scale=False, eps=eps)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(r: Tensor, group_size: int, w: Tensor, eps: float, _group=None) -> Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_g)``."""
    if group_size == 1:
        return torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    centered = _group_centered(r @ w, group_size, scale=False, eps=eps)
    return centered * (group_size / (group_size - 1))


@ADVANTAGE_ESTIMATORS.register("gdpo")
def gdpo_advantages(
    r: Tensor, group_size: int, w: Tensor, eps: float, process_group: dist.ProcessGroup | None = None
) -> Tensor:
    """GDPO: normalise each reward within its group, weight-sum, normalise over the batch."""
    per_reward = _group_centered(r, group_size, scale=True, eps=eps)  # [B, n]
    summed = per_reward @ w
    mean, std, constant = _batch_moments(summed, process_group)
    if constant:
        return torch.zeros_like(summed)
    return (summed - mean) / (std + eps)


def _batch_moments(x: Tensor, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor, bool]:
    """Mean, Bessel std and "all values equal" of ``x`` over this rank and ``group``."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if x.numel() < 2:
            return x.mean(), x.new_zeros(()), True
        return x.mean(), x.std(), bool(x.amax() == x.amin())
    xd = x.double()
    stats = torch.stack([xd.sum(), (xd**2).sum(), xd.new_tensor(float(x.numel()))])
    dist.all_reduce(stats, group=group)
    extremes = torch.stack([xd.amax(), -xd.amin()])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    total, total_sq, n = stats.tolist()
    mean = total / n
    var = max(total_sq - total * mean, 0.0) / (n - 1) if n > 1 else 0.0
    constant = n < 2 or extremes[0].item() == -extremes[1].item()
    return x.new_tensor(mean), x.new_tensor(var**0.5), constant
