"""Tiny random checkpoints of real MoE architectures (for tests, demos, benchmarks:
real weights cannot be downloaded here)."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PretrainedConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

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
}


def tiny_config(model_type: str = "qwen3_moe", **overrides: Any) -> PretrainedConfig:
    """A tiny config of ``model_type`` (``qwen3_moe`` or ``mixtral``)."""
    if model_type not in _TINY:
        raise ValueError(f"no tiny config for {model_type!r}; available: {sorted(_TINY)}")
    config_cls, _, defaults = _TINY[model_type]
    return config_cls(**{**defaults, **overrides})


def save_tiny_checkpoint(path: str | os.PathLike, model_type: str = "qwen3_moe", seed: int = 0, **overrides: Any) -> str:
    """Write a randomly initialised tiny HF checkpoint (fp32 safetensors) to ``path``."""
    config = tiny_config(model_type, **overrides)
    _, model_cls, _ = _TINY[model_type]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    # HF's default init leaves norms at exactly 1; perturb them so loading bugs show
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    return str(path)
