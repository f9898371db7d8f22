"""Routing of a Hugging Face transformers MoE model, in SGLang's layout.

Used by the local rollout engine (to return ``routed_experts`` like SGLang) and by
``moe-rl drift`` on checkpoints. Layers are all hidden layers (SGLang's
``num_layers``); dense layers get experts ``0..k-1`` and are never read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.models.architectures import architecture_of


@torch.no_grad()
def transformers_routing(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-k ``[b, s, num_layers, k]`` and router distributions ``[b, s, num_layers, E]``
    of ``model`` on ``input_ids`` ``[b, s]`` (one forward pass)."""
    cfg = model.config
    arch = architecture_of(cfg)
    k, num_experts = cfg.num_experts_per_tok, arch.num_experts(cfg)
    out = model(input_ids, attention_mask=attention_mask, output_router_logits=True)
    b, s = input_ids.shape
    moe_layers = [l for l, is_moe in enumerate(arch.moe_layer_pattern(cfg)) if is_moe]
    if len(out.router_logits) != len(moe_layers):
        raise ValueError(f"model returned {len(out.router_logits)} router outputs for {len(moe_layers)} MoE layers")
    indices = torch.arange(k).expand(b, s, cfg.num_hidden_layers, k).clone()
    probs = torch.zeros(b, s, cfg.num_hidden_layers, num_experts)
    for layer, logits in zip(moe_layers, out.router_logits):
        logits = logits.float().view(b, s, num_experts)
        indices[:, :, layer] = logits.topk(k, dim=-1).indices
        probs[:, :, layer] = torch.softmax(logits, dim=-1)
    return indices, probs
