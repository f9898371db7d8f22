"""The ``model`` config section: a Hugging Face directory or the built-in tiny model's shape, and
how its layers are built (the choice names live here; :mod:`moe_rl.models.layers` builds them)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from moe_rl.checks import ConfigError, require_choice, require_positive

# families the built-in model can be made of
DEMO_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "glm4_moe", "deepseek_v3")
# how routed experts are built (moe_rl.models.layers.decoder_block_spec)
EXPERT_MODULES = ("grouped", "sequential")
ATTENTION_MODULES = ("sdpa", "local")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@dataclass
class ModelConfig:
    hf_dir: str | None = None  # None: the built-in tiny demo model (warm-started and cached)
    # for the built-in model: qwen3_moe, mixtral, qwen2_moe, olmoe, glm4_moe or deepseek_v3
    architecture: str = "qwen3_moe"
    hidden_size: int = 64  # the built-in model: hidden width
    num_layers: int = 2  # the built-in model: decoder layers (all MoE)
    num_experts: int = 8  # the built-in model: routed experts per layer
    top_k: int = 2  # the built-in model: experts per token
    # routed experts: grouped (stacked weights, a grouped matmul per projection) or sequential
    # (megatron-core's SequentialMLP, one module per expert); checkpoints are the same HF tensors
    experts: str = "grouped"
    # core attention: sdpa (torch's fused scaled_dot_product_attention) or local (megatron's,
    # which keeps [batch x heads, s, s] scores per layer)
    attention: str = "sdpa"
    # linear layers and core attention: local (torch), transformer_engine (Transformer Engine's
    # linears and fused attention, with its fused RoPE and token permutation; the same
    # weights, norms and experts module) or auto (transformer_engine where it imports and a
    # GPU is present, else local)
    transformer_impl: str = "auto"

    def validate(self) -> None:
        require_choice("model.experts", self.experts, EXPERT_MODULES)
        require_choice("model.attention", self.attention, ATTENTION_MODULES)
        require_choice("model.transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        if self.transformer_impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "model.transformer_impl=transformer_engine, but Transformer Engine is not installed (model.transformer_impl=auto or local)"
            )
        if self.hf_dir is not None:
            _check_hf_dir(self.hf_dir)
            return
        require_choice("model.architecture", self.architecture, DEMO_ARCHITECTURES)
        for key in ("hidden_size", "num_layers", "num_experts", "top_k"):
            require_positive(f"model.{key}", getattr(self, key))
        if self.hidden_size % 4:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} must be a multiple of 4 (the built-in model has 4 heads)"
            )
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}")


def _check_hf_dir(hf_dir: str) -> None:
    from moe_rl.models.architectures import ARCHITECTURES, load_hf_config, unsupported_setting

    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.hf_dir={hf_dir!r} has no config.json (a local Hugging Face model directory is needed)"
        )
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"model.hf_dir={hf_dir!r}: config.json is not readable JSON ({type(e).__name__})") from None
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"model.hf_dir={hf_dir!r} has model_type={model_type!r}; supported: {', '.join(ARCHITECTURES.names())}"
        )
    try:
        problem = unsupported_setting(load_hf_config(hf_dir))
    except ValueError as e:
        raise ConfigError(f"model.hf_dir={hf_dir!r}: {e}") from None
    if problem:
        raise ConfigError(f"model.hf_dir={hf_dir!r} ({model_type}): {problem} is not supported")


@dataclass
class WarmStartConfig:
    steps: int = 100  # the built-in model's supervised warm start: steps
    lr: float = 3e-3  # its learning rate
    batch_size: int = 64  # its batch size
    cache_dir: str = "~/.cache/moe-rl"  # where the warm-started model is cached (keyed by the settings that shape it)


@dataclass(frozen=True)
class DemoModelSettings:
    """The run settings the built-in model is made of (:mod:`moe_rl.models.demo_model`):
    its shape, the warm start's, the arithmetic problems it is warm-started on (never the
    held-out ones). Its first weights come from one fixed seed (``demo_model.FIRST_WEIGHTS_SEED``):
    it stands for a pretrained model, the same whatever the run's ``train.seed``."""

    model: ModelConfig
    warm_start: WarmStartConfig
    max_operand: int
    held_out: int
