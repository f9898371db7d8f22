"""Routing drift and expert load accumulated over micro-batches, reduced over ranks.

Every rank adds the routings of the tokens it routed (its data-parallel share, its
sequence-parallel slice, its pipeline stage's layers). Within a pipeline stage those
token sets are disjoint, so per-layer sums all-reduced over the world are exact; the
"changed in any layer" flag of a token is OR-ed over the pipeline stages that hold its
other layers (they route the same tokens) before counting.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.routing.drift import load_cv, load_entropy, overlap


class RoutingStats:
    """Accumulate with :meth:`add_drift` / :meth:`add_load`, then :meth:`reduce` (collective)."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        zeros = lambda: torch.zeros(num_layers, dtype=torch.float64)  # noqa: E731
        self.changed, self.expert_change, self.kl, self.tokens, self.kl_tokens = (zeros() for _ in range(5))
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._flags: list[Tensor] = []
        self._flag_masks: list[Tensor] = []

    def add_drift(
        self,
        layer_numbers: Sequence[int],
        a: Tensor,
        b: Tensor,
        mask: Tensor,
        probs_a: Tensor | None = None,
        probs_b: Tensor | None = None,
    ) -> None:
        """Routings ``a``, ``b`` ``[T, L_local, k]`` of this rank's tokens (``mask`` ``[T]``)."""
        layers = torch.as_tensor(list(layer_numbers), dtype=torch.long)
        w = mask.to(torch.float64)
        k = a.shape[-1]
        same = overlap(a, b)  # [T, L]
        changed = (same < k).to(torch.float64)
        self.changed.index_add_(0, layers, (changed * w[:, None]).sum(0))
        self.expert_change.index_add_(0, layers, ((1 - same.to(torch.float64) / k) * w[:, None]).sum(0))
        self.tokens.index_add_(0, layers, w.sum().expand(len(layers)))
        self._flags.append(changed.amax(-1) if changed.numel() else torch.zeros(a.shape[0], dtype=torch.float64))
        self._flag_masks.append(w)
        if probs_a is not None and probs_b is not None:
            pa, pb = probs_a.to(torch.float64).clamp(min=1e-12), probs_b.to(torch.float64).clamp(min=1e-12)
            kl = (pa * (pa.log() - pb.log())).sum(-1)  # [T, L]
            self.kl.index_add_(0, layers, (kl * w[:, None]).sum(0))
            self.kl_tokens.index_add_(0, layers, w.sum().expand(len(layers)))

    def add_load(self, layer_numbers: Sequence[int], indices: Tensor, mask: Tensor) -> None:
        """Expert load of this rank's tokens ``[T, L_local, k]``."""
        w = mask.to(torch.float64)
        for i, layer in enumerate(layer_numbers):
            self.load[layer] += torch.bincount(
                indices[:, i].reshape(-1).long(),
                weights=w[:, None].expand(-1, indices.shape[-1]).reshape(-1),
                minlength=self.num_experts,
            )

    def reduce(self, pipeline_group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
        """Global metrics (collective when distributed). Per-layer tensors are indexed by
        position in ``layers`` (the MoE layer numbers with data)."""
        sums = torch.stack([self.changed, self.expert_change, self.kl, self.tokens, self.kl_tokens])
        load = self.load.clone()
        flags = torch.cat(self._flags) if self._flags else torch.zeros(0, dtype=torch.float64)
        flag_mask = torch.cat(self._flag_masks) if self._flag_masks else torch.zeros(0, dtype=torch.float64)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed and pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pipeline_group)
        any_counts = torch.stack([(flags * flag_mask).sum(), flag_mask.sum()])
        if distributed:
            for t in (sums, load, any_counts):
                dist.all_reduce(t)
        changed, expert_change, kl, tokens, kl_tokens = sums
        out: dict[str, Tensor] = {}
        drift_layers = (tokens > 0).nonzero().flatten()
        if drift_layers.numel():
            out["drift_layers"] = drift_layers
            out["changed_frac"] = changed[drift_layers] / tokens[drift_layers]
            out["expert_change_frac"] = expert_change[drift_layers] / tokens[drift_layers]
            out["any_layer_changed_frac"] = any_counts[0] / any_counts[1].clamp(min=1)
            if (kl_tokens[drift_layers] > 0).all():
                out["router_kl"] = kl[drift_layers] / kl_tokens[drift_layers]
        load_layers = (load.sum(-1) > 0).nonzero().flatten()
        if load_layers.numel():
            out["load_layers"] = load_layers
            out["expert_load"] = load[load_layers]
            out["expert_load_cv"] = load_cv(load[load_layers])
            out["expert_load_entropy"] = load_entropy(load[load_layers])
        return out
