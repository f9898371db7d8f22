"""What a router would choose and how it spreads its scores, for any router kind
(softmax; sigmoid with an expert bias and group-limited top-k), on megatron-core's and
on transformers' side alike."""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from torch import Tensor


def router_distribution(logits: Tensor, score_function: str) -> Tensor:
    """The router's distribution over experts ``[T, E]`` (for router KL): the softmax of
    its logits, or for a sigmoid router its scores normalised to sum to one (the bias
    only picks experts, so it is not part of it)."""
    logits = logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores / scores.sum(-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


@torch.no_grad()
def natural_topk(logits: Tensor, config: TransformerConfig, expert_bias: Tensor | None) -> Tensor:
    """The experts ``[T, k]`` a megatron-core router with ``config`` picks for ``logits``
    when nothing is replayed: megatron's own top-k routing (bias, groups included), in
    ascending expert order."""
    _, routing_map = topk_routing_with_score_function(
        logits.float(),
        config.moe_router_topk,
        use_pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=config.moe_router_score_function,
        expert_bias=expert_bias,
    )
    return chosen_experts(routing_map, config.moe_router_topk)


def chosen_experts(routing_map: Tensor, k: int) -> Tensor:
    """The ``k`` True columns of a ``[T, E]`` routing map, ``[T, k]`` ascending."""
    return routing_map.to(torch.int8).topk(k, dim=-1).indices.sort(-1).values


class _ChoiceFromNoisyScores:
    """megatron-core's replay seam (``router_replay.get_replay_topk``, called wherever its
    routing takes the top-k) choosing the experts from the scores plus ``noise``: the biased
    scores of a sigmoid router, before any group selection, so groups can flip too. The
    gate values are then megatron's own, from the clean scores at the chosen experts."""

    def __init__(self, noise: Tensor) -> None:
        self.noise = noise
        self.experts: Tensor | None = None

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups, group_topk, default_compute_topk):
        _, self.experts = default_compute_topk(scores + self.noise, topk, num_groups=num_groups, group_topk=group_topk)
        return scores.gather(1, self.experts), self.experts


def route_with_noisy_choice(
    logits: Tensor, noise: Tensor, top_k: int, router: dict, expert_bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Gate values and experts ``[T, k]`` of a router whose choice is made on its scores plus
    ``noise`` ``[T, E]`` while its gates come from its clean ``logits`` ``[T, E]`` by the
    architecture's own formula: megatron-core's routing with ``router``'s settings (an
    :class:`~moe_rl.models.architectures.Architecture`'s ``router(cfg)``), which is what the
    trainer computes for experts it is told to use (routing replay)."""
    choice = _ChoiceFromNoisyScores(noise.to(torch.float32))
    probs, _ = topk_routing_with_score_function(
        logits.float(),
        top_k,
        use_pre_softmax=router.get("moe_router_pre_softmax", False),
        num_groups=router.get("moe_router_num_groups"),
        group_topk=router.get("moe_router_group_topk"),
        scaling_factor=router.get("moe_router_topk_scaling_factor"),
        score_function=router.get("moe_router_score_function", "softmax"),
        expert_bias=expert_bias.float() if expert_bias is not None else None,
        router_replay=choice,
    )
    experts = choice.experts
    assert experts is not None  # (set by the routing call above)
    return probs.gather(1, experts), experts
