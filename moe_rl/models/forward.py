"""Run micro-batches through megatron-core's pipeline schedule.

Every rank calls :func:`run_microbatches` with the same micro-batches (token ids are
cheap to replicate); the first stage embeds them, the last computes per-token log-probs
and entropies (:mod:`moe_rl.models.logprob_head`) and, when training, the loss.

Loss convention: ``loss_fn`` returns each micro-batch's loss already normalised by
*global* counts (see :func:`moe_rl.algorithms.aggregate`), so the schedule sums
micro-batch losses as they are (``calculate_per_token_loss``) and data-parallel
gradients are summed, not averaged: the result is the full batch's gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from moe_rl.models.layers import causal_mask


@dataclass
class MicroBatch:
    """Right-padded token ids ``[b, s]``; log-probs are of ``input_ids[:, 1:]``.

    ``lengths`` ``[b]``: each sequence's real length (``None``: no padding). A loss
    function that needs more (masks, advantages) gets a subclass with those fields."""

    input_ids: Tensor
    lengths: Tensor | None = None

    @property
    def targets(self) -> Tensor:
        """Next-token targets aligned to positions (the last position's is a dummy 0)."""
        return torch.cat([self.input_ids[:, 1:], torch.zeros_like(self.input_ids[:, :1])], dim=1)


def padding_mask(lengths: Tensor | None, seq_len: int, device: torch.device, sequence_parallel: bool) -> Tensor | None:
    """True at the padding positions of right-padded rows, ``[b, s]``, for the MoE routers
    (padding must not count towards the expert-bias load). megatron-core 0.16.1 scatters
    the mask over sequence-parallel ranks on the first pipeline stage only: later stages
    get their slice of it here."""
    if lengths is None:
        return None
    mask = torch.arange(seq_len, device=device)[None, :] >= lengths.to(device)[:, None]
    if sequence_parallel and not ps.is_pipeline_first_stage():
        mask = tensor_parallel.scatter_to_sequence_parallel_region(mask.t().contiguous()).t().contiguous()
    return mask


LossFn = Callable[[Tensor, Any], tuple[Tensor, dict]]  # (logp_entropy, the MicroBatch (subclass)) -> (loss, metrics)


class ForwardHooks(Protocol):
    """Called around each micro-batch's forward on this rank (e.g. routing replay)."""

    def before_forward(self, index: int, num_tokens: int) -> None: ...

    def after_forward(self, index: int) -> None: ...


def run_microbatches(
    model: torch.nn.Module | list[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    *,
    loss_fn: LossFn | None = None,
    forward_only: bool = True,
    hooks: Sequence[ForwardHooks] = (),
) -> list[dict]:
    """Forward (and backward unless ``forward_only``) every micro-batch.

    Returns, on the last pipeline stage, one dict per micro-batch: ``logprobs`` and
    ``entropy`` ``[b, s-1]`` (detached) plus whatever ``loss_fn`` reported; other stages
    get an empty list. ``loss_fn(logp_entropy [b, s-1, 2], micro_batch) -> (loss, metrics)``.
    ``hooks`` see each micro-batch's index and its number of tokens on this rank (the
    sequence-parallel slice), in forward order.
    """
    if not micro_batches:
        return []
    shapes = [tuple(mb.input_ids.shape) for mb in micro_batches]
    chunks = model if isinstance(model, list) else [model]
    config = megatron_module(chunks[0]).config
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = None  # the caller finalizes (no token-count scaling)
    config.variable_seq_lengths = len(set(shapes)) > 1  # pipeline stages then exchange each tensor's shape first
    config.no_sync_func, config.grad_sync_func = _grad_sync_funcs(chunks)
    device = next(chunks[0].parameters()).device
    batches = iter(enumerate(micro_batches))
    sp_size = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1

    def forward_step(data_iterator, model_chunk):
        index, mb = next(data_iterator)
        ids = mb.input_ids.to(device)
        b, s = ids.shape
        positions = torch.arange(s, device=device).unsqueeze(0).expand_as(ids)
        # explicit (True = masked), so that no pass, activation recompute included, builds one
        mask = causal_mask(s, device)
        for hook in hooks:
            hook.before_forward(index, b * s // sp_size)
        padding = padding_mask(mb.lengths, s, device, config.sequence_parallel)
        out = model_chunk(ids, positions, attention_mask=mask, labels=mb.targets.to(device), padding_mask=padding)
        for hook in hooks:
            hook.after_forward(index)
        return out, partial(_loss_wrapper, loss_fn, mb)

    with torch.no_grad() if forward_only else contextlib.nullcontext():  # forward-only: no autograd graph
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=max(s for _, s in shapes),  # with variable lengths only a first guess
            micro_batch_size=max(b for b, _ in shapes),
            forward_only=forward_only,
        )
    return list(results) if ps.is_pipeline_last_stage() else []


def _grad_sync_funcs(chunks: list) -> tuple[Any, Any]:
    """megatron's schedules' hooks for DDP with ``overlap_grad_reduce``: ``no_sync`` around
    all but each chunk's last micro-batch, so the reduce starts once, on the whole
    gradient, whatever the step's micro-batch count (as megatron's own training sets them)."""
    overlapped = [c for c in chunks if getattr(getattr(c, "ddp_config", None), "overlap_grad_reduce", False)]
    if not overlapped:
        return None, None
    if len(overlapped) == 1:
        return overlapped[0].no_sync, overlapped[0].start_grad_sync
    return [c.no_sync for c in overlapped], [c.start_grad_sync for c in overlapped]


def _loss_wrapper(loss_fn: LossFn | None, mb: MicroBatch, output: Tensor):
    logp_entropy = output[:, :-1]  # the last position predicts past the sequence
    report = {"logprobs": logp_entropy[..., 0].detach(), "entropy": logp_entropy[..., 1].detach()}
    if loss_fn is None:
        loss = logp_entropy.sum() * 0.0
    else:
        loss, metrics = loss_fn(logp_entropy, mb)
        report.update(metrics)
    return loss, output.new_ones((), dtype=torch.int), report  # (a fill on the device: no host-to-device copy, no sync)


def megatron_module(module: torch.nn.Module) -> MegatronModule:
    """The megatron module inside its wrappers (DDP, Float16Module)."""
    inner: Any = module
    while hasattr(inner, "module"):
        inner = inner.module
    return inner
