"""Advantage estimators: GRPO, Dr.GRPO, RLOO and GDPO.

Every estimator takes rewards ``[B, n_rewards]`` with the ``group_size`` samples of one
prompt contiguous, reward weights ``[n_rewards]`` and returns one advantage per sample.
Statistics are taken within each group; std is the sample std (Bessel-corrected, as
``torch.std``). A group whose values are all equal gets advantage 0, never NaN.

With a validity mask (``valid``: the multi-turn samples whose generate function did not
fail, under ``rollout.multi_turn.failed_samples=drop``) only the valid samples enter the statistics:
a group of G with f invalid is a group of G - f (one left or none: advantage 0) and the
invalid samples get advantage 0. An estimator registered with ``over_valid`` (GDPO, whose
batch statistics span every valid sample) computes that itself; the others are run on the
valid samples of each group size in turn.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.algorithms.registry import Registry

AdvantageFn = Callable[..., Tensor]  # (rewards [B, n], group_size, weights [n], eps, process_group) -> [B]
ValidGroups = dict[int, list[int]]  # valid samples in a group -> those of every such group (valid_groups)
OverValidFn = Callable[[Tensor, ValidGroups, Tensor, float, "dist.ProcessGroup | None"], Tensor]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn`` over whole groups; ``over_valid`` over the valid
    samples only (``None``: ``fn`` on each group size's valid samples)."""

    fn: AdvantageFn
    over_valid: OverValidFn | None = None


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def estimator(name: str, over_valid: OverValidFn | None = None) -> Callable[[AdvantageFn], AdvantageFn]:
    """Registers the decorated function as advantage estimator ``name``."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name)(AdvantageEstimator(fn, over_valid))
        return fn

    return register


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_size: int,
    *,
    weights: Sequence[float] | Tensor | None = None,
    eps: float = 1e-6,
    process_group: dist.ProcessGroup | None = None,
    valid: Sequence[bool] | None = None,
) -> Tensor:
    """Advantages ``[B]`` for rewards ``[B]`` or ``[B, n_rewards]``.

    ``weights`` weigh the reward columns (default: all 1). ``process_group`` is only
    used by estimators with batch-level statistics (``gdpo``): pass the data-parallel
    group so the batch mean/std span every rank's samples. ``valid`` (``[B]``): only these
    samples enter the statistics, the others get advantage 0 (the module docstring).
    """
    entry = ADVANTAGE_ESTIMATORS.get(name)
    r = _as_reward_matrix(rewards)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if r.shape[0] % group_size != 0:
        raise ValueError(f"batch of {r.shape[0]} rewards is not a whole number of groups of {group_size}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if valid is not None and len(valid) != r.shape[0]:
        raise ValueError(f"got {len(valid)} validity flags for {r.shape[0]} rewards")
    w = _as_weights(weights, r.shape[1], r)
    if valid is None or all(valid):
        return entry.fn(r, group_size, w, eps, process_group)
    groups = valid_groups(valid, group_size)
    if entry.over_valid is not None:
        return entry.over_valid(r, groups, w, eps, process_group)
    return _each_group_size(entry.fn, r, groups, w, eps)


def valid_groups(valid: Sequence[bool], group_size: int) -> ValidGroups:
    """The indices of the valid samples by how many valid samples their group holds, in
    batch order (groups with none left out)."""
    by_size: ValidGroups = defaultdict(list)
    for start in range(0, len(valid), group_size):
        kept = [i for i in range(start, start + group_size) if valid[i]]
        if kept:
            by_size[len(kept)] += kept
    return by_size


def _each_group_size(fn: AdvantageFn, r: Tensor, groups: ValidGroups, w: Tensor, eps: float) -> Tensor:
    """``fn`` on the valid samples of each group size (group-local estimators); 0 elsewhere."""
    out = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for size, indices in groups.items():
        out[indices] = fn(r[indices], size, w, eps, None)
    return out


def _as_reward_matrix(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor):
        rewards = torch.as_tensor(rewards)
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    if rewards.dim() != 2 or rewards.shape[0] == 0:
        raise ValueError(f"rewards must be [B] or [B, n_rewards] with B > 0, got {tuple(rewards.shape)}")
    if rewards.dtype not in (torch.float32, torch.float64):  # integers, and bf16 / fp16 (coarse group statistics)
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


@estimator("grpo")
def grpo_advantages(r: Tensor, group_size: int, w: Tensor, eps: float, _group=None) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` of the weighted reward sum."""
    return _group_centered(r @ w, group_size, scale=True, eps=eps)


@estimator("dr_grpo")
def dr_grpo_advantages(r: Tensor, group_size: int, w: Tensor, eps: float, _group=None) -> Tensor:
    """``r - mean_g`` (Dr.GRPO drops the std division)."""
    return _group_centered(r @ w, group_size, scale=False, eps=eps)


@estimator("rloo")
def rloo_advantages(r: Tensor, group_size: int, w: Tensor, eps: float, _group=None) -> Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_g)``."""
    if group_size == 1:
        return torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    centered = _group_centered(r @ w, group_size, scale=False, eps=eps)
    return centered * (group_size / (group_size - 1))


def _gdpo_over_valid(
    r: Tensor, groups: ValidGroups, w: Tensor, eps: float, process_group: dist.ProcessGroup | None = None
) -> Tensor:
    """GDPO over groups of unequal sizes: each reward normalised within its group (GRPO on
    that column), weight-summed, then normalised over every valid sample of the batch (this
    rank's and ``process_group``'s)."""
    out = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    one = torch.ones(1, dtype=r.dtype, device=r.device)
    for size, indices in groups.items():
        columns = [grpo_advantages(r[indices, j].unsqueeze(1), size, one, eps) for j in range(r.shape[1])]
        out[indices] = torch.stack(columns, dim=1) @ w
    kept = [i for indices in groups.values() for i in indices]
    summed = out[kept]
    mean, std, constant = _batch_moments(summed, process_group)  # (collective: every rank, kept or not)
    if constant:
        return torch.zeros_like(out)
    out[kept] = (summed - mean) / (std + eps)
    return out


@estimator("gdpo", over_valid=_gdpo_over_valid)
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
    """Mean, Bessel std and "all values equal" of ``x`` over this rank and ``group`` (fewer
    than 2 values in all: constant; a rank may hold none)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if x.numel() < 2:
            return x.new_zeros(()), x.new_zeros(()), True
        return x.mean(), x.std(), bool(x.amax() == x.amin())
    xd = x.double()
    stats = torch.stack([xd.sum(), (xd**2).sum(), xd.new_tensor(float(x.numel()))])
    dist.all_reduce(stats, group=group)
    lowest = xd.new_tensor(-torch.inf)  # (a rank without values leaves the extremes to the others)
    extremes = torch.stack([xd.amax(), -xd.amin()]) if x.numel() else torch.stack([lowest, lowest])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    total, total_sq, n = stats.tolist()
    if n < 2:
        return x.new_zeros(()), x.new_zeros(()), True
    mean = total / n
    var = max(total_sq - total * mean, 0.0) / (n - 1)
    constant = extremes[0].item() == -extremes[1].item()
    return x.new_tensor(mean), x.new_tensor(var**0.5), constant
