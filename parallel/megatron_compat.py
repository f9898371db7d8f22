"""Shims megatron-core 0.16.1 needs on every device (CUDA included), applied once before
a model is built. CPU-only shims live in :mod:`parallel.cpu_bridge`, never here."""

from __future__ import annotations


def install() -> None:
    """Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    # moe_utils.router_gating_linear (every TopKRouter.gating) refers to te_general_gemm,
    # which is only defined when Transformer Engine imports: a NameError on the first MoE
    # forward without it. None selects its torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # multi_latent_attention believes Transformer Engine is there whenever megatron's TE
    # extension module imports, which it also does without TE (its TELinear is then None):
    # building MLA fails on isinstance(linear_proj, None). Tell it the truth.
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
    _mask_padding_in_expert_load()


def _mask_padding_in_expert_load() -> None:
    """``TopKRouter._apply_expert_bias`` counts each routed token towards the expert-bias
    load update, leaving out padding with ``routing_map & ~padding_mask``: ``[T, E]`` with
    ``[T]``, which fails to broadcast (0.16.1). Mask each token's row instead."""
    import inspect

    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    if "routing_map & (~padding_mask)" not in inspect.getsource(TopKRouter._apply_expert_bias):
        return  # fixed upstream

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:  # True at padding
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias
