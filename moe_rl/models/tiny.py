"""Tiny random checkpoints of real MoE architectures (for tests, demos, benchmarks:
real weights cannot be downloaded here)."""

from __future__ import annotations

import os
from typing import Any

import torch
from moe_rl.models.architectures import KimiK2Config, KimiK2ForCausalLM
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)
# DeepSeek-V3 / GLM-4.5 style: a dense first layer, 8 experts in 2 groups (one picked per
# token), a shared expert, a routed scaling factor, sigmoid scores with a bias
_DEEPSEEK_STYLE = dict(
    num_hidden_layers=4,
    intermediate_size=64,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)

_TINY: dict[str, tuple[type, type, dict[str, Any]]] = {
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=128,
        ),
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
        ),
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            _COMMON, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4
        ),
    ),
    "olmoe": (
        OlmoeConfig,
        OlmoeForCausalLM,
        dict(_COMMON, intermediate_size=16, num_experts=4, eos_token_id=1, pad_token_id=0),
    ),
    "glm4_moe": (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        dict(_COMMON, **_DEEPSEEK_STYLE, head_dim=8, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5),
    ),
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            _COMMON,
            **_DEEPSEEK_STYLE,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
    # Kimi-K2: DeepSeek-V3's layout with ungrouped routing, its scaling factor and YaRN settings;
    # 3 layers (a dense one, 2 MoE), so that no pipeline of 2 stages splits them evenly
    "kimi_k2": (
        KimiK2Config,
        KimiK2ForCausalLM,
        dict(
            _COMMON,
            **_DEEPSEEK_STYLE,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
        | dict(
            num_hidden_layers=3,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=50000.0,
                factor=16.0,
                original_max_position_embeddings=8,
                beta_fast=1.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
    ),
}
# the ``architectures`` a checkpoint's config names where the class's own name is not the published one
# (Kimi-K2's checkpoints name DeepSeek-V3's, which SGLang serves them with)
_PUBLISHED_CLASS = {"kimi_k2": "DeepseekV3ForCausalLM"}


def tiny_config(model_type: str = "qwen3_moe", **overrides: Any) -> PretrainedConfig:
    """A tiny config of ``model_type`` (any key of ``TINY_ARCHITECTURES``)."""
    if model_type not in _TINY:
        raise ValueError(f"no tiny config for {model_type!r}; available: {sorted(_TINY)}")
    config_cls, _, defaults = _TINY[model_type]
    return config_cls(**{**defaults, **overrides})


def save_tiny_checkpoint(
    path: str | os.PathLike, model_type: str = "qwen3_moe", seed: int = 0, **overrides: Any
) -> str:
    """Write a randomly initialised tiny HF checkpoint (fp32 safetensors) to ``path``."""
    config = tiny_config(model_type, **overrides)
    _, model_cls, _ = _TINY[model_type]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    # HF's default init leaves norms at exactly 1 and router biases at 0; perturb them so
    # loading bugs show (a bias as large as the scores' spread changes which experts win)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=gen))
    model.save_pretrained(path)
    if model_type in _PUBLISHED_CLASS:  # (save_pretrained writes the class's own name)
        model.config.architectures = [_PUBLISHED_CLASS[model_type]]
        model.config.save_pretrained(path)
    return str(path)


TINY_ARCHITECTURES = tuple(_TINY)
