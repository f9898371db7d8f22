"""Hugging Face MoE architectures moe-rl can train, and how each maps onto megatron-core.

An :class:`Architecture` knows (a) which megatron-core ``TransformerConfig`` settings
reproduce the HF model exactly and (b) the HF checkpoint key names of its MoE block.
Attention, norms and embeddings share Llama-style names across these families.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moe_rl.algorithms.registry import Registry
from parallel.layout import ModelDims


@dataclass(frozen=True)
class ExpertKeys:
    """HF key templates of one layer's MoE block (``{l}`` layer, ``{e}`` expert);
    ``expert_bias``: the router's score-correction bias, where the model has one."""

    router: str
    gate: str
    up: str
    down: str
    expert_bias: str | None = None


@dataclass(frozen=True)
class SharedExpertKeys:
    """HF key templates (``{l}``) of a layer's always-on shared expert; ``gate``: its
    sigmoid gate (Qwen2-MoE), else ``None``."""

    gate_proj: str
    up_proj: str
    down_proj: str
    gate: str | None = None


@dataclass(frozen=True)
class Architecture:
    """One HF MoE family. ``router`` gives megatron's router settings, ``shared_size``
    the shared expert's FFN size (``None``: no shared expert), ``qk_norm`` one of
    ``none`` | ``head`` (per head, Qwen3) | ``full`` (over all heads, OLMoE),
    ``unsupported`` the first setting of a config moe-rl cannot reproduce (or ``None``),
    ``attention`` settings of another attention kind (DeepSeek's multi-head latent
    attention: megatron-core's ``MLATransformerConfig`` fields)."""

    model_type: str
    experts: ExpertKeys
    num_experts: Callable[[PretrainedConfig], int]
    moe_ffn_hidden_size: Callable[[PretrainedConfig], int]
    moe_layer_pattern: Callable[[PretrainedConfig], list[int]]
    router: Callable[[PretrainedConfig], dict[str, Any]]
    qk_norm: Callable[[PretrainedConfig], str] = lambda c: "none"
    qkv_bias: Callable[[PretrainedConfig], bool] = lambda c: bool(getattr(c, "attention_bias", False))
    shared: SharedExpertKeys | None = None
    shared_size: Callable[[PretrainedConfig], int | None] = lambda c: None
    unsupported: Callable[[PretrainedConfig], str | None] = lambda c: None
    attention: Callable[[PretrainedConfig], dict[str, Any]] = lambda c: {}  # extra settings (MLA)

    def has_expert_bias(self, cfg: PretrainedConfig) -> bool:
        return bool(self.router(cfg).get("moe_router_enable_expert_bias"))


ARCHITECTURES: Registry[Architecture] = Registry("model architecture (HF model_type)")


def softmax_router(normalize_topk: bool) -> dict[str, Any]:
    """Softmax over all experts, top-k; renormalised over the k when ``normalize_topk``
    (megatron: softmax over the top-k logits, the same numbers)."""
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not normalize_topk)


def sigmoid_router(cfg: PretrainedConfig) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores; the top-k of scores plus a per-expert
    bias (``e_score_correction_bias``) picks the experts, within the best ``topk_group``
    of ``n_group`` groups (a group scores the sum of its top two); the unbiased scores
    at those experts, renormalised and times ``routed_scaling_factor``, weight them."""
    settings: dict[str, Any] = dict(
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
    )
    groups = getattr(cfg, "n_group", None) or 1
    if groups > 1:
        settings.update(moe_router_num_groups=groups, moe_router_group_topk=cfg.topk_group)
    return settings


def _sigmoid_router_problem(cfg: PretrainedConfig) -> str | None:
    k, groups = cfg.num_experts_per_tok, getattr(cfg, "n_group", None) or 1
    if k > 1 and not getattr(cfg, "norm_topk_prob", True):
        return "norm_topk_prob=False with a sigmoid router (megatron-core always renormalises the top-k)"
    if groups > 1 and k // cfg.topk_group != 2:
        return (
            f"n_group={groups} with num_experts_per_tok // topk_group = {k // cfg.topk_group}: a group scores "
            "the sum of its top 2 experts in transformers, of its top k/topk_group in megatron-core"
        )
    return None


def _sparse_step_pattern(cfg: PretrainedConfig) -> list[int]:
    """Qwen-MoE: every ``decoder_sparse_step``-th layer is MoE, except ``mlp_only_layers``."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return [int(l not in dense and (l + 1) % step == 0) for l in range(cfg.num_hidden_layers)]


def _first_dense_pattern(cfg: PretrainedConfig) -> list[int]:
    """DeepSeek-V3 / GLM-4.5: the first ``first_k_dense_replace`` layers are dense."""
    first = getattr(cfg, "first_k_dense_replace", 0) or 0
    return [int(l >= first) for l in range(cfg.num_hidden_layers)]


def _mlp_expert_keys(block: str = "mlp", **extra: str) -> ExpertKeys:
    return ExpertKeys(
        router=f"model.layers.{{l}}.{block}.gate.weight",
        gate=f"model.layers.{{l}}.{block}.experts.{{e}}.gate_proj.weight",
        up=f"model.layers.{{l}}.{block}.experts.{{e}}.up_proj.weight",
        down=f"model.layers.{{l}}.{block}.experts.{{e}}.down_proj.weight",
        **extra,
    )


def _shared_keys(name: str, gate: str | None = None) -> SharedExpertKeys:
    p = f"model.layers.{{l}}.mlp.{name}."
    return SharedExpertKeys(p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight", gate)


def _deepseek_shared_size(cfg: PretrainedConfig) -> int | None:
    n = getattr(cfg, "n_shared_experts", 0) or 0
    return cfg.moe_intermediate_size * n if n else None


ARCHITECTURES.register("qwen3_moe")(
    Architecture(
        model_type="qwen3_moe",
        experts=_mlp_expert_keys(),
        num_experts=lambda c: c.num_experts,
        moe_ffn_hidden_size=lambda c: c.moe_intermediate_size,
        moe_layer_pattern=_sparse_step_pattern,
        router=lambda c: softmax_router(bool(c.norm_topk_prob)),
        qk_norm=lambda c: "head",
    )
)

ARCHITECTURES.register("qwen2_moe")(
    Architecture(
        model_type="qwen2_moe",
        experts=_mlp_expert_keys(),
        num_experts=lambda c: c.num_experts,
        moe_ffn_hidden_size=lambda c: c.moe_intermediate_size,
        moe_layer_pattern=_sparse_step_pattern,
        router=lambda c: softmax_router(bool(c.norm_topk_prob)),
        qkv_bias=lambda c: bool(getattr(c, "qkv_bias", True)),
        shared=_shared_keys("shared_expert", gate="model.layers.{l}.mlp.shared_expert_gate.weight"),
        shared_size=lambda c: c.shared_expert_intermediate_size or None,
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
        num_experts=lambda c: c.num_local_experts,
        moe_ffn_hidden_size=lambda c: c.intermediate_size,
        moe_layer_pattern=lambda c: [1] * c.num_hidden_layers,
        router=lambda c: softmax_router(True),  # Mixtral renormalises its top-k probabilities
    )
)

ARCHITECTURES.register("olmoe")(
    Architecture(
        model_type="olmoe",
        experts=_mlp_expert_keys(),
        num_experts=lambda c: c.num_experts,
        moe_ffn_hidden_size=lambda c: c.intermediate_size,
        moe_layer_pattern=lambda c: [1] * c.num_hidden_layers,
        router=lambda c: softmax_router(bool(c.norm_topk_prob)),
        qk_norm=lambda c: "full",
        unsupported=lambda c: f"clip_qkv={c.clip_qkv}" if getattr(c, "clip_qkv", None) is not None else None,
    )
)

GLM4_MOE = Architecture(
    model_type="glm4_moe",
    experts=_mlp_expert_keys(expert_bias="model.layers.{l}.mlp.gate.e_score_correction_bias"),
    num_experts=lambda c: c.n_routed_experts,
    moe_ffn_hidden_size=lambda c: c.moe_intermediate_size,
    moe_layer_pattern=_first_dense_pattern,
    router=sigmoid_router,
    qk_norm=lambda c: "head" if getattr(c, "use_qk_norm", False) else "none",
    shared=_shared_keys("shared_experts"),
    shared_size=_deepseek_shared_size,
    unsupported=_sigmoid_router_problem,
)
ARCHITECTURES.register("glm4_moe")(GLM4_MOE)


def _mla_settings(cfg: PretrainedConfig) -> dict[str, Any]:
    """DeepSeek-V3 multi-head latent attention in megatron-core's terms (YaRN RoPE too)."""
    settings: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        kv_channels=cfg.v_head_dim,
        num_query_groups=cfg.num_attention_heads,
        qk_layernorm=True,  # the norms of the compressed q and kv
        rotary_base=rope_theta(cfg),
        rope_type="rope",
    )
    params = _rope_parameters(cfg)
    if params.get("rope_type") == "yarn":
        settings.update(
            rope_type="yarn",
            rotary_scaling_factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 1.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    return settings


def _mla_problem(cfg: PretrainedConfig) -> str | None:
    if getattr(cfg, "attention_bias", False):
        return "attention_bias=True with multi-head latent attention"
    if not getattr(cfg, "rope_interleave", True):
        return "rope_interleave=False (megatron-core's MLA rotates interleaved pairs)"
    return _sigmoid_router_problem(cfg)


# DeepSeek-V3: GLM-4.5's MoE layers under multi-head latent attention
DEEPSEEK_V3 = dataclasses.replace(
    GLM4_MOE,
    model_type="deepseek_v3",
    qk_norm=lambda c: "none",
    attention=_mla_settings,
    unsupported=_mla_problem,
)
ARCHITECTURES.register("deepseek_v3")(DEEPSEEK_V3)
# Kimi-K2: DeepSeek-V3's layout and tensor names under its own model_type (61 layers, the first dense)
ARCHITECTURES.register("kimi_k2")(dataclasses.replace(DEEPSEEK_V3, model_type="kimi_k2"))


class KimiK2Config(DeepseekV3Config):
    """Kimi-K2's ``config.json`` (``model_type: kimi_k2``). transformers 5 ships no class for
    it and Kimi's checkpoints name remote code (``auto_map``), which offline loading cannot
    fetch; their fields are DeepSeek-V3's, so DeepSeek-V3's class reads them, as SGLang's
    own ``kimi_k2`` alias does."""

    model_type = "kimi_k2"


class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
    """transformers' DeepSeek-V3 model for a ``kimi_k2`` config (the reference of parity,
    drift and the local engine)."""

    config_class = KimiK2Config


def _register_with_transformers(config_class: type[PretrainedConfig], model_class: type, like: str) -> None:
    """Let transformers' Auto classes load ``config_class.model_type`` directories with these
    classes and checkpoint conversions of model type ``like`` (unless transformers knows
    the model type itself)."""
    if config_class.model_type in CONFIG_MAPPING:
        return
    AutoConfig.register(config_class.model_type, config_class)
    AutoModelForCausalLM.register(config_class, model_class)
    register_checkpoint_conversion_mapping(config_class.model_type, get_checkpoint_conversion_mapping(like))


_register_with_transformers(KimiK2Config, KimiK2ForCausalLM, like="deepseek_v3")


def load_hf_config(path: str) -> PretrainedConfig:
    """The ``config.json`` of a local HF model directory (never a hub download)."""
    if not Path(path).exists():
        raise ValueError(f"{path!r} does not exist (a Hugging Face model directory is needed)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a Hugging Face config from {path!r}: {e}") from None


def architecture_of(hf_config: PretrainedConfig) -> Architecture:
    return ARCHITECTURES.get(hf_config.model_type)


def head_dim(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_parameters(cfg: PretrainedConfig) -> dict:
    """transformers 5 keeps RoPE settings in ``rope_parameters``; 4.x in attributes."""
    return getattr(cfg, "rope_parameters", None) or {}


def rope_theta(cfg: PretrainedConfig) -> float:
    return float(_rope_parameters(cfg).get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _rope_problem(cfg: PretrainedConfig, arch: Architecture) -> str | None:
    rope_type = _rope_parameters(cfg).get("rope_type", "default") or "default"
    handled = ("default", "yarn") if arch.attention(cfg).get("multi_latent_attention") else ("default",)
    return None if rope_type in handled else f"rope_type={rope_type!r} (supported here: {', '.join(handled)})"


def rotary_fraction(cfg: PretrainedConfig) -> float:
    """The share of each head's dimensions that RoPE rotates (GLM-4.5: 0.5, the first half)."""
    fraction = _rope_parameters(cfg).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    return float(fraction or 1.0)


def model_dims(hf_config: PretrainedConfig) -> ModelDims:
    arch = architecture_of(hf_config)
    return ModelDims(
        num_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        num_experts=arch.num_experts(hf_config),
        vocab_size=hf_config.vocab_size,
        ffn_hidden_size=arch.moe_ffn_hidden_size(hf_config),
        shared_ffn_hidden_size=arch.shared_size(hf_config),
    )


def unsupported_setting(hf_config: PretrainedConfig) -> str | None:
    """Why moe-rl cannot reproduce ``hf_config`` exactly, or ``None``."""
    arch = architecture_of(hf_config)
    if getattr(hf_config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        return f"hidden_act={hf_config.hidden_act!r} (only silu)"
    return arch.unsupported(hf_config) or _rope_problem(hf_config, arch)


def transformer_config_kwargs(hf_config: PretrainedConfig) -> dict[str, Any]:
    """``TransformerConfig`` settings that reproduce ``hf_config`` (parallel sizes,
    dtypes and training knobs are added by the builder)."""
    arch = architecture_of(hf_config)
    problem = unsupported_setting(hf_config)
    if problem:
        raise ValueError(f"{hf_config.model_type}: {problem} is not supported")
    shared = arch.shared_size(hf_config)
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=arch.qk_norm(hf_config) != "none",
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias(hf_config),
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=arch.num_experts(hf_config),
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_layer_freq=arch.moe_layer_pattern(hf_config),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None and arch.shared is not None and arch.shared.gate is not None,
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
        **arch.router(hf_config),
    ) | arch.attention(hf_config)


def hf_dtype(hf_config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype
