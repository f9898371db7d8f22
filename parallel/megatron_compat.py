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
    _foreach_grad_norm_and_clip()
    _adam_step_in_reshardable_load()
    _adam_step_per_parameter_on_load()


def _foreach_grad_norm_and_clip() -> None:
    """Without Transformer Engine or apex, megatron-core's grad norm and clipping fall back
    to ``local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``: a norm and a
    ``float()`` per tensor (on a GPU a device sync each) and a multiply-then-copy per tensor.
    torch's foreach kernels take the list at once: the same per-tensor norms and products
    (bit-equal on a CPU; fused and without the syncs on a GPU). TE's and apex's kernels,
    where megatron found them, stay."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = foreach_scale


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s interface (as megatron's local fallback): the l2 norm
    of every tensor of ``tensor_lists`` together, ``[1]`` fp32 on their device; no per-tensor norms."""
    import torch

    norms = torch.stack([torch.stack(torch._foreach_norm(tensors)) for tensors in tensor_lists])
    return torch.norm(norms.to(torch.float32)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """``amp_C.multi_tensor_scale``'s interface: ``tensor_lists[1][i] = tensor_lists[0][i] * scale``."""
    import torch

    sources, targets = tensor_lists[0], tensor_lists[1]
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


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


def _adam_step_in_reshardable_load() -> None:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every entry of a
    parameter's optimizer state from the loaded tensors (0.16.1). torch Adam (the optimizer
    without Apex or Transformer Engine) keeps its ``step`` there too, which
    ``load_state_dict`` has already set from the checkpoint's parameter groups: a
    ``fully_reshardable`` load leaves it out (a KeyError on resume), a ``dp_reshardable``
    one passes the step the state had before the load (a placeholder's, which would
    overwrite the loaded one). Copy the other entries. Without gradients: a
    ``dp_reshardable`` load runs with autograd on, and where the master weights are the
    parameters themselves (fp32 training) their in-place copy fails."""
    import inspect

    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if "dst_tensors[key].copy_(tensors[key])" not in inspect.getsource(original):
        return  # fixed upstream (or already wrapped)

    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors) -> None:
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        for key, target in targets.items():
            if key != "step":
                target.copy_(tensors[key])

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _adam_step_per_parameter_on_load() -> None:
    """``DistributedOptimizer.load_state_dict`` (torch Adam, without Apex or Transformer
    Engine) gives every parameter's state one shared ``step`` tensor, which torch Adam then
    increments once per parameter: after a resume the bias correction runs ahead by the
    parameter count at every step (0.16.1). Give each parameter its own copy."""
    import inspect

    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict
    if 's["step"] = step' not in inspect.getsource(original):
        return  # fixed upstream (or already wrapped)

    def load_state_dict(self, state_dict) -> None:
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict
