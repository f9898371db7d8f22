"""The megatron-core layer spec moe-rl builds models with: the local (pure torch) spec
with an RMSNorm that works under sequence parallelism, and OLMoE's QK-norm over all
heads."""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from moe_rl.config import EXPERT_MODULES
from moe_rl.models.grouped_experts import GroupedExperts


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


class FullWidthQKNorm(torch.nn.Module):
    """RMSNorm of all query (or key) heads of a token together, as OLMoE normalises
    ``q_proj``'s whole output (megatron's ``qk_layernorm`` normalises each head).

    Input ``[s, b, heads on this rank, head_dim]``; under tensor parallelism each rank
    holds its heads' slice of the weight and the sum of squares is all-reduced (forward
    and backward: every rank's output depends on every rank's heads)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, *, num_heads: int, **_unused) -> None:
        super().__init__()
        self.eps = eps
        self.tp = config.tensor_model_parallel_size
        self.width = num_heads * hidden_size  # hidden_size: megatron passes the head dim
        local = num_heads // self.tp * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(local, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp > 1:
            squares = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(squares))
        normed = x32 * torch.rsqrt(squares / self.width + self.eps)
        return self.weight.view(x.shape[-2:]) * normed.to(x.dtype)


class LatentAttentionCore(DotProductAttention):
    """megatron-core's local attention for multi-head latent attention: MLA passes the
    query/key and value head sizes (``k_channels``, ``v_channels``), which the local
    class (0.16) does not take; it already works with any query/key size, and its output
    is sized by ``kv_channels``, which the MLA config sets to the value head size."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(f"MLA value head size {v_channels} != kv_channels {self.config.kv_channels}")


def decoder_block_spec(config: TransformerConfig, qk_norm: str = "none", experts: str = "grouped") -> TransformerBlockSubmodules:
    """This pipeline stage's local-spec decoder layers (MoE or dense, by
    ``config.moe_layer_freq``) whose input, pre-MLP, QK and final norms are
    :class:`RMSNorm` (the stock torch norm refuses sequence parallelism).
    ``qk_norm``: ``none``, ``head`` (each head) or ``full`` (:class:`FullWidthQKNorm`);
    ``experts``: ``grouped`` (:class:`GroupedExperts`) or ``sequential`` (megatron's
    ``SequentialMLP``)."""
    if experts not in EXPERT_MODULES:
        raise ValueError(f"experts={experts!r} is not one of {', '.join(EXPERT_MODULES)}")
    norm = ModuleSpec(module=RMSNorm)
    q_norm, k_norm = {
        "none": (None, None),
        "head": (norm, norm),
        "full": (
            ModuleSpec(module=FullWidthQKNorm, params={"num_heads": config.num_attention_heads}),
            ModuleSpec(module=FullWidthQKNorm, params={"num_heads": config.num_query_groups}),
        ),
    }[qk_norm]
    layer_specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in {id(s): s for s in layer_specs}.values():
        sub = spec.submodules
        sub.input_layernorm = norm
        sub.pre_mlp_layernorm = norm
        if config.multi_latent_attention:  # the norms of the compressed q and kv (DeepSeek)
            sub.self_attention.submodules.q_layernorm = norm
            sub.self_attention.submodules.kv_layernorm = norm
            sub.self_attention.submodules.core_attention = ModuleSpec(module=LatentAttentionCore)
        elif config.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = q_norm
            sub.self_attention.submodules.k_layernorm = k_norm
        if experts == "grouped" and isinstance(sub.mlp.submodules, MoESubmodules):
            sub.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    offset = get_transformer_layer_offset(config)
    local = layer_specs[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm)
