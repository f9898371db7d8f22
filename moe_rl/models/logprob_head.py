"""Per-token log-probs and entropies of given targets, vocabulary-parallel and chunked.

A policy never needs full-vocabulary logits: only ``log p(target)`` and the entropy of
each position. :class:`LogProbHead` makes a megatron-core ``GPTModel`` return exactly
those, ``[batch, seq, 2]`` (log-prob, entropy), when it is called with ``labels``
(the targets):

- the output layer stops at the (sequence-parallel-gathered) hidden states;
- :func:`vocab_parallel_logprobs` multiplies them by this rank's vocabulary shard of the
  output weight, one chunk of positions at a time, and combines the shards' max, sum-exp,
  target logit and ``sum p*z`` with all-reduces over the tensor-parallel group: no rank
  ever holds more than ``chunk x vocab/TP`` logits (``chunk`` tokens: positions of all the
  micro-batch's rows together), and a chunk's logits are
  recomputed in the backward pass instead of being kept (activation checkpointing), unless
  they are small (``LogProbConfig.keep_logits_mb``).

Logits are fp32 whatever the activations' dtype (:func:`fp32_logits`): bf16 logits in
[16, 32) move in steps of 0.125, far above the log-ratio bands the losses clip at. The
output weight's gradient is summed over chunks in fp32, in megatron DDP's ``main_grad``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from torch import Tensor
from torch.utils.checkpoint import checkpoint


@dataclass
class LogProbConfig:
    temperature: float = 1.0
    # tokens per logits chunk (positions x the micro-batch's rows; at least one position): the
    # peak holds a few fp32 chunk x vocab/TP tensors whatever the rows (151,936 / 1: ~1.9 GB)
    chunk_size: int = 1024
    with_entropy: bool = True
    vocab_size: int | None = None  # the real vocabulary; rows past it (TP padding) get no probability
    # a chunk whose fp32 logits take at most this much is kept for the backward pass (with
    # its few logit-sized intermediates) instead of recomputed: recomputing saves nothing
    # worth its time there (small vocabularies, short micro-batches)
    keep_logits_mb: float = 32.0


class _Fp32Logits(torch.autograd.Function):
    """``hidden [n, h] @ weight[V, h].T`` in fp32 from bf16/fp16 inputs.

    Forward: ``torch.mm(out_dtype=fp32)`` where torch has it (CUDA: the tensor cores
    accumulate in fp32 anyway, only the rounding to bf16 is skipped), else both upcast (CPU).
    Backward: the input gradient in the input's dtype. The weight gradient goes in fp32
    straight into megatron DDP's ``main_grad`` where the weight has one (megatron's
    gradient-accumulation-fusion protocol: ``grad_added_to_main_grad``, a dummy gradient,
    zeroed for a weight shared with the embedding): autograd would otherwise sum the
    chunks' gradients in bf16, one rounding per chunk. Only the chunk that
    ``carries_weight_grad`` hands autograd the dummy, so the others allocate nothing.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, carries_weight_grad: bool) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        # the parameter itself, for megatron's attributes: a saved tensor comes back as
        # another object under activation checkpointing, without them
        ctx.weight_param = weight
        ctx.carries_weight_grad = carries_weight_grad
        if has_fp32_output_matmul(weight.device.type, weight.dtype):
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return torch.mm(hidden.float(), weight.float().t())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        hidden, weight = ctx.saved_tensors
        low_precision = has_fp32_output_matmul(weight.device.type, weight.dtype)
        if low_precision:  # the bf16 matmuls, as for any bf16 linear layer
            grad = grad.to(hidden.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = grad @ weight if low_precision else (grad @ weight.float()).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            param = ctx.weight_param
            if _has_fp32_main_grad(param):
                _add_fp32_product(param.main_grad, grad.t(), hidden)
                param.grad_added_to_main_grad = True
                if ctx.carries_weight_grad:
                    grad_weight = (torch.zeros_like if getattr(param, "zero_out_wgrad", False) else torch.empty_like)(
                        weight
                    )
            else:
                grad_weight = (grad.t() @ hidden) if low_precision else (grad.t() @ hidden.float()).to(weight.dtype)
        return grad_hidden, grad_weight, None


def _has_fp32_main_grad(weight: Tensor) -> bool:
    """Whether megatron DDP gave ``weight`` an fp32 gradient buffer it accepts direct sums in."""
    main_grad = getattr(weight, "main_grad", None)
    return main_grad is not None and main_grad.dtype == torch.float32 and hasattr(weight, "grad_added_to_main_grad")


def _add_fp32_product(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` with fp32 accumulation and no fp32 copy of a bf16 ``a`` or ``b`` where
    torch's ``addmm(out_dtype=fp32)`` runs (CUDA), else through one fp32 product."""
    if a.dtype == torch.float32:  # the CPU path: the gradient is fp32 already
        out.addmm_(a, b.float())
    elif has_fp32_accumulating_addmm(out.device.type, a.dtype):
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out.add_(torch.mm(a, b, out_dtype=torch.float32))


@functools.cache
def has_fp32_output_matmul(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs for ``dtype`` inputs here
    (CUDA with torch >= 2.8; not the CPU)."""
    try:
        torch.mm(
            torch.ones(1, 1, dtype=dtype, device=device_type),
            torch.ones(1, 1, dtype=dtype, device=device_type),
            out_dtype=torch.float32,
        )
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def has_fp32_accumulating_addmm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(out, a, b, out_dtype=torch.float32, out=out)`` adds a ``dtype``
    product into an fp32 ``out`` in place here (checked on values: 1 + 1*1 = 2)."""
    try:
        out = torch.ones(1, 1, device=device_type)
        one = torch.ones(1, 1, dtype=dtype, device=device_type)
        torch.addmm(out, one, one, out_dtype=torch.float32, out=out)
        return out.item() == 2.0
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def fp32_logits(hidden: Tensor, weight: Tensor, *, carries_weight_grad: bool = True) -> Tensor:
    """``hidden [..., h] @ weight[V, h].T`` in fp32: as is for fp32/fp64 inputs, else through
    :class:`_Fp32Logits`. Of several calls on one weight in one backward pass (chunks), one
    ``carries_weight_grad`` (see there)."""
    if weight.dtype in (torch.float32, torch.float64):
        return torch.matmul(hidden, weight.t())
    flat = _Fp32Logits.apply(hidden.reshape(-1, hidden.shape[-1]), weight, carries_weight_grad)
    return flat.view(*hidden.shape[:-1], weight.shape[0])


def vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    config: LogProbConfig = LogProbConfig(),
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """``log softmax(hidden @ weight.T / T)[target]`` and the entropy, ``[s, b]`` each.

    ``hidden`` ``[s, b, h]`` is the full sequence (replicated over TP); ``weight``
    ``[V/TP, h]`` is this rank's vocabulary shard; ``targets`` ``[s, b]`` are global ids.
    Rows at or past ``config.vocab_size`` (padding that makes V divide by TP) are left out.
    """
    if group is None and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    tp_size = dist.get_world_size(group) if group is not None else 1
    vocab_start = weight.shape[0] * (dist.get_rank(group) if tp_size > 1 else 0)
    real_rows = (
        weight.shape[0] if config.vocab_size is None else min(weight.shape[0], max(config.vocab_size - vocab_start, 0))
    )
    positions = max(1, config.chunk_size // max(hidden.shape[1], 1))
    chunk_logits_mb = min(positions, hidden.shape[0]) * hidden.shape[1] * weight.shape[0] * 4 / 2**20
    recompute = torch.is_grad_enabled() and chunk_logits_mb > config.keep_logits_mb
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], positions):
        chunk = slice(start, start + positions)
        args = (
            hidden[chunk],
            weight,
            targets[chunk],
            vocab_start,
            real_rows,
            config.temperature,
            config.with_entropy,
            group if tp_size > 1 else None,
            start == 0,
        )
        logp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args)
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies)


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_start: int,
    real_rows: int,
    temperature: float,
    with_entropy: bool,
    group: dist.ProcessGroup | None,
    carries_weight_grad: bool,
) -> tuple[Tensor, Tensor]:
    logits = fp32_logits(hidden, weight, carries_weight_grad=carries_weight_grad)
    if temperature != 1.0:
        logits = logits / temperature
    padded = real_rows < weight.shape[0]
    if padded:  # vocabulary padding: -inf logits, so no mass and no gradient
        logits = logits.masked_fill(torch.arange(weight.shape[0], device=logits.device) >= real_rows, float("-inf"))
    local_max = logits.detach().amax(-1)
    if group is not None:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    z = logits - local_max.unsqueeze(-1)
    exp_z = z.exp()
    if padded:  # exp(-inf) = 0, but 0 * -inf in the entropy would be NaN
        z = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
    local = targets - vocab_start
    in_shard = (local >= 0) & (local < weight.shape[0])
    target_z = torch.gather(z, -1, local.clamp(0, weight.shape[0] - 1).unsqueeze(-1)).squeeze(-1)
    target_z = torch.where(in_shard, target_z, torch.zeros_like(target_z))
    parts = [exp_z.sum(-1), target_z]
    if with_entropy:
        parts.append((exp_z * z).sum(-1))
    stacked = torch.stack(parts)
    if group is not None:
        stacked = tensor_parallel.reduce_from_tensor_model_parallel_region(stacked, group=group)
    log_sum_exp = stacked[0].log()
    logp = stacked[1] - log_sum_exp
    if with_entropy:
        entropy = log_sum_exp - stacked[2] / stacked[0]
    else:
        entropy = torch.zeros_like(logp)
    return logp, entropy


class _DeferredOutputLayer(ColumnParallelLinear):
    """The model's output layer, stopping before the vocabulary projection: it returns
    the hidden states of the whole sequence, gathered over sequence-parallel ranks."""

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output=None, **_):
        if self.sequence_parallel:
            input_ = tensor_parallel.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
        elif dist.get_world_size(self.tp_group) > 1:
            input_ = tensor_parallel.copy_to_tensor_model_parallel_region(input_)
        return input_, None


class LogProbHead:
    """Turns a last-stage ``GPTModel`` into a log-prob model (see the module docstring)."""

    @staticmethod
    def attach(model: GPTModel, config: LogProbConfig | None = None) -> None:
        model.output_layer.__class__ = _DeferredOutputLayer
        model.logprob_config = config or LogProbConfig()
        model.compute_language_model_loss = _compute_logprobs.__get__(model)


def _compute_logprobs(model: GPTModel, labels: Tensor, hidden: Tensor) -> Tensor:
    """Replaces ``compute_language_model_loss``: ``[b, s, 2]`` (log-prob, entropy)."""
    if model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight()
    else:
        weight = model.output_layer.weight
    logp, entropy = vocab_parallel_logprobs(hidden, weight, labels.transpose(0, 1), config=model.logprob_config)
    return torch.stack([logp, entropy], dim=-1).transpose(0, 1).contiguous()
