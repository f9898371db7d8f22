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
