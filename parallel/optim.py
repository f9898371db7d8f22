"""megatron-core DDP, the (distributed) Adam optimizer and one training step.

Gradients are summed (not averaged) over data-parallel ranks: the policy losses are
normalised by global token/sequence counts (see :mod:`moe_rl.models.forward`).
megatron-core is imported where it is used, so that reading a run config
(:class:`OptimSettings`) stays light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer import TransformerConfig


@dataclass
class OptimSettings:
    """The optimizer knobs a user sets (the rest follows the model's dtype); the run
    config's ``optim`` section is this type. ``extra`` passes further megatron-core
    ``OptimizerConfig`` fields through."""

    lr: float = 2e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad value (``optim.<key>=...``)."""
        for key in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
            if not math.isfinite(getattr(self, key)):
                raise ValueError(f"optim.{key}={getattr(self, key)} must be a finite number")
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        for key in ("weight_decay", "clip_grad"):
            if getattr(self, key) < 0:
                raise ValueError(f"optim.{key}={getattr(self, key)} must be >= 0")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")
        if not self.adam_eps > 0:
            raise ValueError(f"optim.adam_eps={self.adam_eps} must be > 0")


def wrap_ddp(model: torch.nn.Module, config: TransformerConfig, settings: OptimSettings) -> DistributedDataParallel:
    """megatron-core DDP with fp32 gradient buffers, summed over data-parallel ranks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config.calculate_per_token_loss = True  # DDP then sums instead of averaging
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        average_in_collective=False,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(chunks: list[DistributedDataParallel], settings: OptimSettings) -> MegatronOptimizer:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    settings.validate()
    config = chunks[0].config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        **settings.extra,
    )
    return get_megatron_optimizer(opt_config, chunks)


@dataclass
class StepResult:
    updated: bool
    grad_norm: float
    outputs: list[dict]


def train_step(
    chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    forward_backward: Callable[[], list[dict]],
) -> StepResult:
    """Zero gradients, run ``forward_backward`` (e.g. :func:`run_microbatches` with
    ``forward_only=False``), reduce gradients across ranks, clip and step.

    ``updated`` is False when the gradients held NaN/Inf and the step was skipped."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = forward_backward()
    finalize_model_grads(chunks)
    if not _grads_finite(chunks):
        # NaN/Inf anywhere on any rank: skip the update everywhere (weights stay as they were)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        return StepResult(updated=False, grad_norm=float("nan"), outputs=outputs)
    updated, grad_norm, _ = optimizer.step()
    return StepResult(updated=bool(updated), grad_norm=float(grad_norm or 0.0), outputs=outputs)


def _grads_finite(chunks: list[DistributedDataParallel]) -> bool:
    """True when no rank holds a NaN/Inf gradient (one device sync, one all-reduce)."""
    from parallel.collectives import any_rank

    finite = [
        torch.isfinite(param.main_grad).all()
        for chunk in chunks
        for param in chunk.module.parameters()
        if getattr(param, "main_grad", None) is not None
    ]
    local_bad = bool(finite) and not bool(torch.stack(finite).all())
    return not any_rank(local_bad)
