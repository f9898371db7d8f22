"""Combinators on reward columns ``[B, n_rewards]`` applied before advantages."""

from __future__ import annotations

import torch
from torch import Tensor


def conditional_reward(rewards: Tensor, target: int, condition: int, threshold: float) -> Tensor:
    """Column ``target`` counts only where column ``condition`` is ``>= threshold``
    (``r_k := r_k if r_l >= t else 0``), e.g. a length reward only for correct answers.
    Returns a new tensor; the input is unchanged."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, n_rewards], got {tuple(rewards.shape)}")
    n = rewards.shape[1]
    for label, col in (("target", target), ("condition", condition)):
        if not -n <= col < n:
            raise ValueError(f"{label} column {col} out of range for {n} reward columns")
    out = rewards.clone()
    out[:, target] = torch.where(rewards[:, condition] >= threshold, rewards[:, target], 0.0)
    return out
