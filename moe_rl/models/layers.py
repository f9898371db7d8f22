"""The megatron-core layer spec moe-rl builds models with: the local (pure torch) spec
with an RMSNorm that works under sequence parallelism."""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 (as Hugging Face models do), cast back to the input dtype.

    Its weight carries ``sequence_parallel`` so that megatron-core all-reduces its
    gradient across tensor-parallel ranks when each rank sees a slice of the sequence.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def decoder_block_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """This pipeline stage's local-spec decoder layers (MoE or dense, by
    ``config.moe_layer_freq``) whose input, pre-MLP, QK and final norms are
    :class:`RMSNorm` (the stock torch norm refuses sequence parallelism)."""
    norm = ModuleSpec(module=RMSNorm)
    layer_specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in {id(s): s for s in layer_specs}.values():
        sub = spec.submodules
        sub.input_layernorm = norm
        sub.pre_mlp_layernorm = norm
        if config.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = norm
            sub.self_attention.submodules.k_layernorm = norm
    offset = get_transformer_layer_offset(config)
    local = layer_specs[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm)
