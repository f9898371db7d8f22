"""Build this rank's part of a megatron-core GPTModel from a Hugging Face config."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from transformers import PretrainedConfig

from moe_rl.models.architectures import architecture_of, rope_theta, rotary_fraction, transformer_config_kwargs
from moe_rl.models.layers import LayerModules, decoder_block_spec
from moe_rl.models.logprob_head import LogProbConfig, LogProbHead
from moe_rl.models.token_dispatch import use_one_rank_dispatchers
from parallel.collectives import rank_device
from parallel.layout import ParallelLayout


def make_transformer_config(
    hf_config: PretrainedConfig,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype | None = None,
    modules: LayerModules = LayerModules(),
    **overrides: Any,
) -> TransformerConfig:
    """megatron-core config: the architecture's settings, the parallel layout, the dtype
    (bf16 on CUDA, fp32 on CPU unless given), the fusions that come with ``modules``'
    implementation (:func:`transformer_engine_fusions`) and any ``overrides`` (e.g.
    recompute, ``moe_enable_routing_replay``, ``moe_aux_loss_coeff``)."""
    if params_dtype is None:
        params_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    kwargs = transformer_config_kwargs(hf_config)
    kwargs.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        **layout.megatron_stage_layers(hf_config.num_hidden_layers),  # uneven stages where the layers do not divide
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.use_sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=rank_device().type == "cpu",  # else megatron builds each shard on the device
        moe_token_dispatcher_type=token_dispatcher_type(layout),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )
    if modules.transformer_engine:
        kwargs.update(transformer_engine_fusions(bool(kwargs.get("multi_latent_attention"))))
    kwargs.update(overrides)
    config_class = MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig
    return config_class(**kwargs)


def transformer_engine_fusions(multi_latent_attention: bool) -> dict[str, bool]:
    """Transformer Engine's fused RoPE (not under MLA, where megatron-core's is a
    training-only experiment and the log-prob passes run forward only) and fused token
    permutation. Not its fused router (it would bypass routing replay), nor weight-gradient
    accumulation fusion (megatron's local output layer would then need apex)."""
    return {"apply_rope_fusion": not multi_latent_attention, "moe_permute_fusion": True}


def token_dispatcher_type(layout: ParallelLayout) -> str:
    """megatron-core's token dispatcher: ``alltoall`` where experts are spread over ranks;
    ``allgather`` where each rank holds every expert whole (EP = expert TP = 1), which then
    moves no tokens between ranks and runs fewer ops (same outputs; ~9% off a tiny
    model's update on CPU). Micro-batches of different lengths (``variable_seq_lengths``,
    which megatron's config check refuses with allgather) are safe there: allgather's
    trouble is ranks of its expert group gathering unequal token counts, and that group is
    this rank alone."""
    return "allgather" if layout.ep == 1 and layout.expert_tp == 1 else "alltoall"


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and the routers' expert biases (buffers that training
    changes and checkpoints, exports and weight syncs must carry), in a fixed order."""
    weights: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    weights += [(name, b) for name, b in model.named_buffers() if name.endswith("router.expert_bias")]
    return weights


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron splits the vocabulary rows evenly over tensor-parallel ranks; a vocabulary
    that does not divide gets padding rows (never scored, stripped on export)."""
    return -(-vocab_size // tp) * tp


def build_model(
    hf_config: PretrainedConfig,
    config: TransformerConfig,
    logprob_config: LogProbConfig | None = None,
    modules: LayerModules = LayerModules(),
) -> GPTModel:
    """This rank's pipeline stage of the model (initialised randomly: load weights next),
    its layers' experts and attention built as ``modules`` says.

    The output layer is a :class:`LogProbHead`: the model returns per-token log-probs
    and entropies of given targets (at ``logprob_config.temperature``) instead of
    full-vocabulary logits.
    """
    pre = parallel_state.is_pipeline_first_stage()
    post = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, architecture_of(hf_config).qk_norm(hf_config), modules),
        vocab_size=padded_vocab_size(hf_config.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        rotary_percent=rotary_fraction(hf_config),
    )
    use_one_rank_dispatchers(model)
    if post:
        logprob_config = dataclasses.replace(logprob_config or LogProbConfig(), vocab_size=hf_config.vocab_size)
        LogProbHead.attach(model, logprob_config)
    # megatron-core 0.16.1 marks expert weights allreduce=True when EP == 1, so DDP never
    # sums their gradients across the tensor-parallel ranks that see other tokens
    # (ETP < TP) and the replicas diverge silently (upstream Megatron-LM PR #5916).
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.allreduce = False
    if not config.use_cpu_initialization:
        _params_onto(model, rank_device())
    return model


def _params_onto(model: torch.nn.Module, device: torch.device) -> None:
    """Put every parameter on ``device`` (attributes kept). megatron's router creates its
    weight on the CPU whatever ``use_cpu_initialization`` says and moves it at its first
    forward: after DDP's buffers and the optimizer's fp32 copy were made from the CPU
    tensor (megatron's own ``get_model`` calls ``model.cuda()`` for this)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.device != device:
                moved = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                moved.__dict__.update(param.__dict__)
                setattr(module, name, moved)
