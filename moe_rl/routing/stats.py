"""Routing drift and expert load accumulated over micro-batches, reduced over ranks.

Every rank adds the routings of the tokens it routed (its data-parallel share, its
sequence-parallel slice, its pipeline stage's layers). Within a pipeline stage those
token sets are disjoint, so per-layer sums all-reduced over the world are exact; the
"changed in any layer" flag of a token is OR-ed over the pipeline stages that hold its
other layers (they route the same tokens) before counting.

Inputs may live on the rank's device; the accumulators follow them there (the first
micro-batch's device), so adding a micro-batch never waits for the device (no copy to the
host inside a pass); :meth:`RoutingStats.reduce` moves them to the host once per pass, and
the reductions run on the process group's device (:func:`parallel.collectives.all_reduce`).

Per-token values (:meth:`RoutingStats.add_token_values`, given by the last pipeline
stage: the rollout log-prob mismatch, an update's log-ratios and clipping) are split by
the same "changed in any layer" flag: their means over tokens whose routing differed and
over those whose routing agreed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_rl.routing.drift import load_cv, load_entropy, overlap
from parallel.collectives import all_reduce


class RoutingStats:
    """Accumulate with :meth:`add_drift` / :meth:`add_load`, then :meth:`reduce` (collective)."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        zeros = lambda: torch.zeros(num_layers, dtype=torch.float64)  # noqa: E731
        self.changed, self.expert_change, self.kl, self.tokens, self.kl_tokens = (zeros() for _ in range(5))
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.disagreement = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._flags: list[Tensor] = []
        self._flag_masks: list[Tensor] = []
        self._value_names: tuple[str, ...] = ()
        self._values: list[Tensor] = []  # per add_drift call: [len(names) + 1, T] (values..., weight)
        self._device: torch.device | None = None  # where the accumulators live (the inputs' device)
        self._layer_indices: dict[tuple[int, ...], Tensor] = {}  # made once: a host-to-device copy syncs

    def _accumulate_on(self, device: torch.device) -> None:
        """The accumulators on ``device`` (moved there, still zeros, at the first input)."""
        if self._device is None:
            self._device = device
            for name in ("changed", "expert_change", "kl", "tokens", "kl_tokens", "load", "disagreement"):
                setattr(self, name, getattr(self, name).to(device))

    def _layer_index(self, layer_numbers: Sequence[int]) -> Tensor:
        key = tuple(layer_numbers)
        if key not in self._layer_indices:
            self._layer_indices[key] = torch.tensor(key, dtype=torch.long, device=self._device)
        return self._layer_indices[key]

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
        self._accumulate_on(a.device)
        layers = self._layer_index(layer_numbers)
        w = mask.to(device=a.device, dtype=torch.float64)
        k = a.shape[-1]
        same = overlap(a, b)  # [T, L]
        changed = (same < k).to(torch.float64)
        self.changed.index_add_(0, layers, (changed * w[:, None]).sum(0).to(self._device))
        self.disagreement.index_add_(0, layers, _one_sided_counts(a, b, w, self.num_experts).to(self._device))
        self.expert_change.index_add_(
            0, layers, ((1 - same.to(torch.float64) / k) * w[:, None]).sum(0).to(self._device)
        )
        self.tokens.index_add_(0, layers, w.sum().to(self._device).expand(len(layers)))
        flags = changed.amax(-1) if changed.numel() else torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
        self._flags.append(flags)
        self._flag_masks.append(w)
        if probs_a is not None and probs_b is not None:
            kl = token_router_kl(probs_a, probs_b)  # [T, L]
            self.kl.index_add_(0, layers, (kl * w[:, None]).sum(0).to(self._device))
            self.kl_tokens.index_add_(0, layers, w.sum().to(self._device).expand(len(layers)))

    def add_token_values(self, names: tuple[str, ...], values: Sequence[Tensor | None]) -> None:
        """Per-token values for the :meth:`add_drift` calls that have none yet: one
        ``[len(names) + 1, T]`` per call in this rank's token order, the last row each
        token's weight (1 on response tokens, 0 where a value does not count; more than 1
        where a token stands for others, under sampling); ``None``
        where this rank has no log-probs (not the last pipeline stage): zeros, summed over
        the pipeline stages with the last stage's values. :meth:`reduce` reports each
        name's weighted mean over all tokens, over tokens whose routing changed in any
        layer (``<name>_routing_changed``) and over the rest (``<name>_routing_same``)."""
        if self._values and names != self._value_names:
            raise ValueError(f"token values {names} after {self._value_names}: one kind per statistics")
        self._value_names = names
        pending = self._flags[len(self._values) :]
        if len(values) != len(pending):
            raise ValueError(f"{len(values)} token values for {len(pending)} routings")
        for v, flags in zip(values, pending):
            shape = (len(names) + 1, flags.shape[0])
            v = torch.zeros(shape, dtype=torch.float64, device=flags.device) if v is None else v.to(torch.float64)
            if tuple(v.shape) != shape:
                raise ValueError(f"token values must be {list(shape)} (values..., weights), got {list(v.shape)}")
            self._values.append(v)

    def add_load(self, layer_numbers: Sequence[int], indices: Tensor, mask: Tensor) -> None:
        """Expert load of this rank's tokens ``[T, L_local, k]``."""
        self._accumulate_on(indices.device)
        w = mask.to(device=indices.device, dtype=torch.float64)
        for i, layer in enumerate(layer_numbers):
            self.load[layer] += _weighted_counts(
                indices[:, i].reshape(-1).long(), w[:, None].expand(-1, indices.shape[-1]).reshape(-1), self.num_experts
            ).to(self._device)

    def reduce(self, pipeline_group: dist.ProcessGroup | None = None, replicas: int = 1) -> dict[str, Tensor]:
        """Global metrics (collective when distributed). Per-layer tensors are indexed by
        position in ``layers`` (the MoE layer numbers with data). ``replicas``: how many
        ranks hold each token's values (pipeline stages, tensor-parallel ranks without
        sequence parallelism), for the token counts."""
        # the pass's accumulators to the host, once
        sums = torch.stack([self.changed, self.expert_change, self.kl, self.tokens, self.kl_tokens]).cpu()
        flags = torch.cat(self._flags).cpu() if self._flags else torch.zeros(0, dtype=torch.float64)
        flag_mask = torch.cat(self._flag_masks).cpu() if self._flag_masks else torch.zeros(0, dtype=torch.float64)
        if pipeline_group is not None:
            flags = all_reduce(flags, "max", group=pipeline_group)
        any_counts = torch.stack([(flags * flag_mask).sum(), flag_mask.sum()])
        split = self._split_values(flags, pipeline_group)
        sums, any_counts, split = (all_reduce(t) for t in (sums, any_counts, split))
        load, disagreement = all_reduce(torch.stack([self.load, self.disagreement]).cpu())
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
            out["expert_disagreement"] = disagreement[drift_layers] / tokens[drift_layers, None]
        out.update(self._split_metrics(split, replicas))
        load_layers = (load.sum(-1) > 0).nonzero().flatten()
        if load_layers.numel():
            out["load_layers"] = load_layers
            out["expert_load"] = load[load_layers]
            out["expert_load_cv"] = load_cv(load[load_layers])
            out["expert_load_entropy"] = load_entropy(load[load_layers])
        return out

    def _split_values(self, flags: Tensor, pipeline_group: dist.ProcessGroup | None) -> Tensor:
        """``[C, 2]``: per row of the token values, its weighted sums over routing-changed
        and routing-same tokens of this rank, and in the last row the sums of the weights
        themselves (values summed over the pipeline stages first, flags already OR-ed over them)."""
        if not self._values:
            return torch.zeros(0, 2, dtype=torch.float64)
        values = torch.cat(self._values, dim=1).cpu()
        if pipeline_group is not None:  # the last stage's values, on every stage of the pipeline
            values = all_reduce(values, group=pipeline_group)
        weights = values[-1]
        changed, same = flags[: weights.shape[0]] * weights, (1 - flags[: weights.shape[0]]) * weights
        sums = torch.stack([(values[:-1] * changed).sum(-1), (values[:-1] * same).sum(-1)], dim=-1)
        return torch.cat([sums, torch.stack([changed.sum(), same.sum()])[None]])

    def _split_metrics(self, split: Tensor, replicas: int) -> dict[str, Tensor]:
        """Means of the token values overall, over routing-changed and routing-same tokens."""
        if not split.numel() or split[-1].sum() <= 0:
            return {}
        (changed_w, same_w), total_w = split[-1], split[-1].sum()
        out = {
            "routing_changed_response_frac": changed_w / total_w,
            "routing_changed_tokens": changed_w / replicas,
            "routing_same_tokens": same_w / replicas,
        }
        for name, (changed, same) in zip(self._value_names, split[:-1]):
            out[name] = (changed + same) / total_w
            if changed_w > 0:
                out[f"{name}_routing_changed"] = changed / changed_w
            if same_w > 0:
                out[f"{name}_routing_same"] = same / same_w
        return out


def _one_sided_counts(a: Tensor, b: Tensor, w: Tensor, num_experts: int) -> Tensor:
    """``[L, E]``: weighted tokens for which expert ``e`` is in exactly one of the two
    top-k sets (``count_a(e) + count_b(e) - 2 count_both(e)``)."""
    t, l, k = a.shape
    offsets = (torch.arange(l, device=a.device) * num_experts).view(1, l, 1)
    weights = w.view(t, 1, 1).expand(t, l, k)
    in_b = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)  # [T, L, k]: a's choice also in b

    def counts(indices: Tensor, weight: Tensor) -> Tensor:
        flat = (indices.long() + offsets).reshape(-1)
        return _weighted_counts(flat, weight.reshape(-1), l * num_experts).view(l, num_experts)

    return counts(a, weights) + counts(b, weights) - 2 * counts(a, weights * in_b)


def _weighted_counts(flat: Tensor, weights: Tensor, size: int) -> Tensor:
    """``torch.bincount(flat, weights, minlength=size)`` for indices known to be below
    ``size``, without bincount's host reads (on CUDA it reads the input's min and max back:
    two syncs per call, inside the update pass)."""
    return torch.zeros(size, dtype=weights.dtype, device=flat.device).index_add_(0, flat, weights)


def token_router_kl(probs_a: Tensor, probs_b: Tensor, eps: float = 1e-12) -> Tensor:
    """KL(a || b) of router distributions ``[T, L, E]`` per token and layer ``[T, L]``, in
    fp64 on ``probs_b``'s device, one layer at a time: ``probs_a`` may wait on the host
    (pinned: each layer's slice comes over without a sync), and the transient is a layer's
    ``[T, E]`` (at Qwen3-30B-A3B's 48 x 128, ~4 KB a token instead of ~220 KB)."""
    out = torch.empty(probs_b.shape[:2], dtype=torch.float64, device=probs_b.device)
    for layer in range(probs_b.shape[1]):
        pa = probs_a[:, layer].to(device=probs_b.device, dtype=torch.float64, non_blocking=True).clamp(min=eps)
        pb = probs_b[:, layer].to(torch.float64).clamp(min=eps)
        out[:, layer] = (pa * (pa.log() - pb.log())).sum(-1)
    return out
