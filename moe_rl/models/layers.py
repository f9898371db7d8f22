"""The megatron-core layer spec moe-rl builds models with: the local (pure torch) spec
with an RMSNorm that works under sequence parallelism, and OLMoE's QK-norm over all
heads; with Transformer Engine, its linear layers and fused attention in place of the
local ones (same parameters and names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from moe_rl.models.settings import ATTENTION_MODULES, EXPERT_MODULES, TRANSFORMER_IMPLS
from moe_rl.models.grouped_experts import GroupedExperts, init_device


def transformer_engine_usable() -> bool:
    """Whether Transformer Engine imports (megatron-core's own test) and a CUDA device is
    there to run it."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE and torch.cuda.is_available()


@dataclass(frozen=True)
class LayerModules:
    """Which implementation builds a decoder layer's parts (``model.experts``,
    ``model.attention``, ``model.transformer_impl``): ``grouped`` (:class:`GroupedExperts`)
    or ``sequential`` (megatron's ``SequentialMLP``); ``sdpa`` (:class:`SdpaAttention`) or
    ``local`` (megatron's ``DotProductAttention``, ``[batch x heads, s, s]`` scores);
    ``local`` (torch) linears and attention, or ``transformer_engine``'s (``auto``: where
    :func:`transformer_engine_usable`)."""

    experts: str = "grouped"
    attention: str = "sdpa"
    transformer_impl: str = "local"

    def __post_init__(self) -> None:
        choices = (
            ("experts", self.experts, EXPERT_MODULES),
            ("attention", self.attention, ATTENTION_MODULES),
            ("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS),
        )
        for key, value, valid in choices:
            if value not in valid:
                raise ValueError(f"{key}={value!r} is not one of {', '.join(valid)}")

    @property
    def transformer_engine(self) -> bool:
        """Whether the layers are Transformer Engine's (``auto`` resolved on this machine)."""
        if self.transformer_impl == "auto":
            return transformer_engine_usable()
        return self.transformer_impl == "transformer_engine"


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 (as Hugging Face models do), cast back to the input dtype.

    Its weight carries ``sequence_parallel`` so that megatron-core all-reduces its
    gradient across tensor-parallel ranks when each rank sees a slice of the sequence.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=init_device(config)))
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron's mark

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm: x * rsqrt(mean(x^2) + eps), one fused kernel on CUDA; on a CPU the
        # same operations as written out (bit-equal, forward and backward: tests)
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class FullWidthQKNorm(torch.nn.Module):
    """RMSNorm of all query (or key) heads of a token together, as OLMoE normalises
    ``q_proj``'s whole output (megatron's ``qk_layernorm`` normalises each head).

    Input ``[s, b, heads on this rank, head_dim]``; under tensor parallelism each rank
    holds its heads' slice of the weight and the sum of squares is all-reduced (forward
    and backward: every rank's output depends on every rank's heads)."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, *, num_heads: int, **_unused
    ) -> None:
        super().__init__()
        self.eps = eps
        self.tp = config.tensor_model_parallel_size
        self.width = num_heads * hidden_size  # hidden_size: megatron passes the head dim
        local = num_heads // self.tp * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(local, dtype=config.params_dtype, device=init_device(config)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp > 1:
            squares = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(squares))
        normed = x32 * torch.rsqrt(squares / self.width + self.eps)
        return self.weight.view(x.shape[-2:]) * normed.to(x.dtype)


# per device, square causal masks of growing lengths (each at least twice the one before),
# kept: a pass's mask stays recognisable while its backward recomputes, whatever came after
_CAUSAL_MASKS: dict[torch.device, list[torch.Tensor]] = {}


def causal_mask(length: int, device: torch.device | str) -> torch.Tensor:
    """``[1, 1, length, length]``, True above the diagonal (masked): the mask the forward
    passes give megatron's attention, a view of the top-left block of one square mask kept
    per device (so passes of every length share a few allocations: at 32K tokens one mask is
    1 GiB; and :class:`SdpaAttention` recognises it and attends causally without reading it)."""
    device = torch.device(device)
    kept = _CAUSAL_MASKS.setdefault(device, [])
    if not kept or kept[-1].shape[-1] < length:
        size = max(length, 2 * kept[-1].shape[-1]) if kept else length
        positions = torch.arange(size, device=device)
        kept.append(positions[None, :] > positions[:, None])
    full = next(m for m in kept if m.shape[-1] >= length)
    return full[:length, :length][None, None]


def is_shared_causal_mask(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is one of :func:`causal_mask`'s (never builds one): a square
    top-left view of a kept mask. megatron's activation recompute re-runs a layer on
    ``detach()``ed copies of its inputs, other objects over the same memory, which must take
    the same (causal) kernel path."""
    if mask.dim() != 4 or mask.shape[:2] != (1, 1) or mask.shape[-1] != mask.shape[-2]:
        return False
    return any(
        mask.data_ptr() == full.data_ptr() and mask.stride()[-2:] == full.stride() and mask.shape[-1] <= len(full)
        for full in _CAUSAL_MASKS.get(mask.device, [])
    )


class SdpaAttention(DotProductAttention):
    """megatron-core's local core attention computed by torch's
    ``scaled_dot_product_attention``: fused kernels, no ``[batch x heads, s, s]`` scores
    kept (flash or memory-efficient kernels on GPUs). Given :func:`causal_mask` (or no
    mask, with a causal mask type) it attends causally (``is_causal``); any other mask
    (True = masked) is applied as given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.softmax_type != "vanilla" or self.config.window_size is not None:
            raise ValueError("SdpaAttention runs vanilla-softmax full attention only (model.attention=local otherwise)")

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaAttention takes no attention bias or packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, heads, d] -> [b, heads, s, d]
        length = q.shape[2]
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and length == k.shape[2] and length > 1
        if attention_mask is not None and is_shared_causal_mask(attention_mask):
            attention_mask = None
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=causal and attention_mask is None,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [s, b, heads * v dim]


class LatentAttentionCore(DotProductAttention):
    """megatron-core's local attention for multi-head latent attention: MLA passes the
    query/key and value head sizes (``k_channels``, ``v_channels``), which the local
    class (0.16) does not take; it already works with any query/key size, and its output
    is sized by ``kv_channels``, which the MLA config sets to the value head size."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(f"MLA value head size {v_channels} != kv_channels {self.config.kv_channels}")


class LatentSdpaAttention(SdpaAttention, LatentAttentionCore):
    """:class:`SdpaAttention` taking MLA's query/key and value head sizes."""


def decoder_block_spec(
    config: TransformerConfig, qk_norm: str = "none", modules: LayerModules = LayerModules()
) -> TransformerBlockSubmodules:
    """This pipeline stage's local-spec decoder layers (MoE or dense, by
    ``config.moe_layer_freq``) whose input, pre-MLP, QK and final norms are
    :class:`RMSNorm` (the stock torch norm refuses sequence parallelism).
    ``qk_norm``: ``none``, ``head`` (each head) or ``full`` (:class:`FullWidthQKNorm`);
    ``modules`` picks the experts and the core attention."""
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
            latent_core = LatentSdpaAttention if modules.attention == "sdpa" else LatentAttentionCore
            sub.self_attention.submodules.core_attention = ModuleSpec(module=latent_core)
        else:
            if modules.attention == "sdpa":
                sub.self_attention.submodules.core_attention = ModuleSpec(module=SdpaAttention)
            if config.qk_layernorm:
                sub.self_attention.submodules.q_layernorm = q_norm
                sub.self_attention.submodules.k_layernorm = k_norm
        if modules.experts == "grouped" and isinstance(sub.mlp.submodules, MoESubmodules):
            sub.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    if modules.transformer_engine:
        for spec in {id(s): s for s in layer_specs}.values():
            _use_transformer_engine(spec.submodules)
    offset = get_transformer_layer_offset(config)
    local = layer_specs[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm)


def _use_transformer_engine(submodules) -> None:
    """In place, through a layer spec's submodules: megatron's local column- and
    row-parallel linears become Transformer Engine's (megatron's ``TESpecProvider``
    choices; the same ``weight`` parameters, no norm folded in, so checkpoints, exports
    and weight syncs are unchanged) and the core attention TE's fused attention. Norms
    and the experts module stay as chosen."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    if not HAVE_TE:
        raise ValueError(
            "transformer_impl=transformer_engine, but Transformer Engine does not import here (transformer_impl=local or auto)"
        )
    te = TESpecProvider()
    swaps = {ColumnParallelLinear: te.column_parallel_linear(), RowParallelLinear: te.row_parallel_linear()}

    def visit(sub) -> None:
        for field in dataclasses.fields(sub):
            value = getattr(sub, field.name)
            if field.name == "core_attention":
                setattr(sub, field.name, te.core_attention())
            elif isinstance(value, type) and value in swaps:
                setattr(sub, field.name, swaps[value])
            elif isinstance(value, ModuleSpec) and dataclasses.is_dataclass(value.submodules):
                visit(value.submodules)

    visit(submodules)
