"""The routers' expert biases (aux-loss-free load balancing: DeepSeek-V3, GLM-4.5).

megatron-core moves each bias by ``moe_router_bias_update_rate`` towards a balanced
load at every optimizer step (``finalize_model_grads``); the bias picks experts but
does not weight them, so it changes routing while no weight does. This measures how
much a step moved them: ``routing/expert_bias_delta/layer_<l>`` (mean |change| over
the layer's experts) and ``.../mean``; :meth:`ExpertBiasTracker.before` lets the routing
monitor measure what the change alone did to routing (``routing/expert_bias_effect/...``).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from moe_rl import tags
from moe_rl.routing.replay import moe_layers
from parallel.collectives import all_reduce


class ExpertBiasTracker:
    """This pipeline stage's routers with an expert bias. :meth:`start` before a step's
    updates, :meth:`deltas` after (collective over the pipeline group)."""

    def __init__(self, model: torch.nn.Module, moe_layer_numbers: list[int], num_layers: int) -> None:
        self.routers = [(n, r) for n, r in moe_layers(model) if getattr(r, "expert_bias", None) is not None]
        self.moe_layer_numbers = moe_layer_numbers
        self.num_layers = num_layers
        self._before: list[torch.Tensor] = []

    def start(self) -> None:
        self._before = [router.expert_bias.detach().clone() for _, router in self.routers]

    def before(self) -> dict[int, torch.Tensor]:
        """This stage's biases as :meth:`start` saw them, by layer number."""
        return {layer: bias for (layer, _), bias in zip(self.routers, self._before)}

    def deltas(self) -> dict[str, float]:
        """Mean |bias change| per MoE layer since :meth:`start`, by tag (every stage's
        layers, summed over the pipeline group; each layer lives on one stage)."""
        if len(self._before) != len(self.routers):
            raise RuntimeError("ExpertBiasTracker.deltas() without start()")
        device = self.routers[0][1].expert_bias.device if self.routers else torch.device("cpu")
        values = torch.zeros(self.num_layers, device=device)
        for (layer, router), before in zip(self.routers, self._before):
            values[layer] = (router.expert_bias.detach() - before).abs().mean()
        values = all_reduce(values, group=ps.get_pipeline_model_parallel_group()).cpu()
        self._before = []
        out = {tags.routing("expert_bias_delta", layer=l): float(values[l]) for l in self.moe_layer_numbers}
        out[tags.routing("expert_bias_delta")] = (
            float(values[self.moe_layer_numbers].mean()) if self.moe_layer_numbers else 0.0
        )
        return out
