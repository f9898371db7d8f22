"""A token dispatcher for megatron-core's ``MoELayer`` where the expert group is this rank
alone, which never waits for the device.

megatron-core 0.16.1's dispatchers read the expert counts on the host in every MoE layer's
forward: the allgather one copies ``tokens_per_expert`` to the CPU and permutes with two
``masked_select`` calls (each a device-to-host sync for its output size); the alltoall one
syncs before sorting its chunks. On a GPU each sync drains the queue, so the host then
launches the layer's remaining kernels while the device idles. Where every expert is local
and no token is dropped, the permutation's size is known (tokens x top-k) and its order can
be found on the device: :class:`OneRankTokenDispatcher`, given to such layers at build
(:func:`use_one_rank_dispatchers`). Layers elsewhere keep megatron's.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


def keeps_every_token(config: TransformerConfig) -> bool:
    """Whether each token goes to exactly ``moe_router_topk`` experts (dropless routing: no
    capacity, no padding of the expert inputs), so a permutation has a fixed size."""
    return (
        config.moe_expert_capacity_factor is None
        and not config.moe_pad_expert_input_to_capacity
        and not config.moe_router_padding_for_quantization
    )


class OneRankTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's allgather dispatcher for an expert group of one rank (tensor x expert
    parallel size 1), permuting without a device-to-host sync: the same permutation (expert
    by expert, tokens in order within each), found by a stable sort of the routing map,
    with the per-expert counts left on the device (:class:`GroupedExperts` takes them there).
    The gather and the combine are megatron's (no communication at this group size)."""

    routing_map: Tensor | None  # [tokens, experts], set by megatron's dispatch_preprocess

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.hidden_shape_before_permute = hidden_states.shape
        routing_map = self.routing_map  # every expert is local
        assert routing_map is not None
        tokens = routing_map.shape[0]
        expert_major = routing_map.T.reshape(-1).to(torch.int8)
        # the routed (expert, token) pairs first, each expert's in token order: masked_select's order
        chosen = torch.argsort(expert_major, descending=True, stable=True)[: tokens * self.router_topk]
        token_of_pair = chosen % tokens
        self.local_map = routing_map
        self.local_probs = probs.T.reshape(-1).index_select(0, chosen)
        self.reversed_local_input_permutation_mapping = token_of_pair
        self.routing_map = None
        return hidden_states.index_select(0, token_of_pair), routing_map.sum(dim=0), self.local_probs


def use_one_rank_dispatchers(model: torch.nn.Module) -> int:
    """Give each MoE layer of ``model`` whose allgather dispatcher serves a one-rank expert
    group with dropless routing and megatron's unfused permutation, and whose experts take their counts on the device
    (:class:`GroupedExperts`), a :class:`OneRankTokenDispatcher` on the same groups (once, at
    build: nothing branches on the dispatcher later). How many layers got one."""
    swapped = 0
    for layer in model.modules():
        old: Any = getattr(layer, "token_dispatcher", None)
        if (
            isinstance(layer, MoELayer)
            and type(old) is MoEAllGatherTokenDispatcher
            and old.tp_size == old.ep_size == 1
            and keeps_every_token(layer.config)
            and not layer.config.moe_permute_fusion  # (TE's fused unpermute reads its own row map, not our index)
            and getattr(layer.experts, "counts_on_device", False)
        ):
            groups = ProcessGroupCollection(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
            layer.token_dispatcher = OneRankTokenDispatcher(
                layer.num_local_experts, layer.local_expert_indices, config=layer.config, pg_collection=groups
            )
            swapped += 1
    return swapped
