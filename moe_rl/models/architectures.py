"""Hugging Face MoE architectures moe-rl can train, and how each maps onto megatron-core.

An :class:`Architecture` knows (a) which megatron-core ``TransformerConfig`` settings
reproduce the HF model exactly and (b) the HF checkpoint key names of its MoE block.
Attention, norms and embeddings share Llama-style names across these families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from moe_rl.algorithms.registry import Registry
from parallel.layout import ModelDims


@dataclass(frozen=True)
class ExpertKeys:
    """HF key templates of one layer's MoE block (``{l}`` layer, ``{e}`` expert)."""

    router: str
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class Architecture:
    model_type: str
    experts: ExpertKeys
    qk_norm: bool
    num_experts: Callable[[PretrainedConfig], int]
    moe_ffn_hidden_size: Callable[[PretrainedConfig], int]
    normalize_topk: Callable[[PretrainedConfig], bool]
    moe_layer_pattern: Callable[[PretrainedConfig], list[int]]


ARCHITECTURES: Registry[Architecture] = Registry("model architecture (HF model_type)")


def _qwen3_moe_pattern(cfg: PretrainedConfig) -> list[int]:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return [int(l not in dense and (l + 1) % step == 0) for l in range(cfg.num_hidden_layers)]


ARCHITECTURES.register("qwen3_moe")(
    Architecture(
        model_type="qwen3_moe",
        experts=ExpertKeys(
            router="model.layers.{l}.mlp.gate.weight",
            gate="model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
            up="model.layers.{l}.mlp.experts.{e}.up_proj.weight",
            down="model.layers.{l}.mlp.experts.{e}.down_proj.weight",
        ),
        qk_norm=True,
        num_experts=lambda c: c.num_experts,
        moe_ffn_hidden_size=lambda c: c.moe_intermediate_size,
        normalize_topk=lambda c: bool(c.norm_topk_prob),
        moe_layer_pattern=_qwen3_moe_pattern,
    )
)

ARCHITECTURES.register("mixtral")(
    Architecture(
        model_type="mixtral",
        experts=ExpertKeys(
            router="model.layers.{l}.block_sparse_moe.gate.weight",
            gate="model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
            up="model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
            down="model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
        ),
        qk_norm=False,
        num_experts=lambda c: c.num_local_experts,
        moe_ffn_hidden_size=lambda c: c.intermediate_size,
        normalize_topk=lambda c: True,  # Mixtral renormalises its top-k probabilities
        moe_layer_pattern=lambda c: [1] * c.num_hidden_layers,
    )
)


def architecture_of(hf_config: PretrainedConfig) -> Architecture:
    return ARCHITECTURES.get(hf_config.model_type)


def head_dim(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rope_theta(cfg: PretrainedConfig) -> float:
    """transformers 5 keeps it in ``rope_parameters``; 4.x in ``rope_theta``."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope_type={params['rope_type']!r} is not supported yet (only default RoPE)")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def model_dims(hf_config: PretrainedConfig) -> ModelDims:
    arch = architecture_of(hf_config)
    return ModelDims(
        num_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        num_experts=arch.num_experts(hf_config),
        vocab_size=hf_config.vocab_size,
        ffn_hidden_size=arch.moe_ffn_hidden_size(hf_config),
    )


def transformer_config_kwargs(hf_config: PretrainedConfig) -> dict[str, Any]:
    """``TransformerConfig`` settings that reproduce ``hf_config`` (parallel sizes,
    dtypes and training knobs are added by the builder)."""
    arch = architecture_of(hf_config)
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported (only silu)")
    pattern = arch.moe_layer_pattern(hf_config)
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=arch.num_experts(hf_config),
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_pre_softmax=not arch.normalize_topk(hf_config),
        moe_router_score_function="softmax",
        moe_layer_freq=pattern,
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
    )


def hf_dtype(hf_config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype
