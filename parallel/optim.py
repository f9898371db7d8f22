"""megatron-core DDP, the (distributed) Adam optimizer and one training step.

Gradients are summed (not averaged) over data-parallel ranks: the policy losses are
normalised by global token/sequence counts (see :mod:`moe_rl.models.forward`).
megatron-core is imported where it is used, so that reading a run config
(:class:`OptimSettings`) stays light.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

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

    lr: float = 2e-4  # peak learning rate
    min_lr: float = 0.0  # where a decay ends
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # Adam
    adam_beta2: float = 0.999  # Adam
    adam_eps: float = 1e-8  # Adam
    clip_grad: float = 1.0  # 0 disables clipping
    # learning rate per RL step (constant over its updates): linear warmup, step s < warmup_steps
    # at lr * (s + 1) / warmup_steps, then constant, or a linear / cosine decay that would
    # reach min_lr one step after decay_steps (0: train.steps); min_lr after that
    lr_schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0  # linear warmup steps
    decay_steps: int = 0  # 0: train.steps
    # shard optimizer state and master weights over data-parallel ranks; None: when a
    # data-parallel group (dense or expert) has more than one rank (with one there is
    # nothing to shard and the shard all-gather is pure overhead)
    use_distributed_optimizer: bool | None = None
    overlap_grad_reduce: bool = False  # DDP: reduce gradients in buckets while the backward runs
    # torch's fused AdamW kernel (CPU and GPU) where megatron-core falls back to torch's
    # AdamW (no Transformer Engine or apex, whose fused Adam it takes then); false: torch's
    # multi-tensor (foreach) form
    fused_adam: bool = True
    # the MoE routers' learning rate as a multiple of the rest's (their own parameter group, on the
    # same schedule): routing can move as fast as at scale while the rest of the model moves gently
    router_lr_mult: float = 1.0
    extra: dict = field(default_factory=dict)  # further megatron-core OptimizerConfig fields

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
        if not (math.isfinite(self.router_lr_mult) and self.router_lr_mult > 0):
            raise ValueError(f"optim.router_lr_mult={self.router_lr_mult} must be a finite number > 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.lr_schedule={self.lr_schedule!r} is not valid; valid: {', '.join(LR_SCHEDULES)}")
        for key in ("warmup_steps", "decay_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"optim.{key}={getattr(self, key)} must be >= 0")
        self._validate_extra()

    def _validate_extra(self) -> None:
        """``extra``: fields of megatron-core's ``OptimizerConfig`` that moe-rl does not set
        itself (checked now: the optimizer is built after the model and its weights)."""
        if not self.extra:
            return  # (megatron's optimizer module imported only to check some)
        import dataclasses

        from megatron.core.optimizer import OptimizerConfig

        valid = {f.name for f in dataclasses.fields(OptimizerConfig)} - MOE_RL_OPTIMIZER_FIELDS
        for key in self.extra:
            if key in MOE_RL_OPTIMIZER_FIELDS:
                raise ValueError(f"optim.extra.{key}: moe-rl sets it (from optim.{key} where there is one)")
            if key not in valid:
                close = difflib.get_close_matches(key, sorted(valid), n=1)
                raise ValueError(
                    f"optim.extra.{key} is not a field of megatron-core's OptimizerConfig"
                    + (f" (did you mean {close[0]}?)" if close else "")
                )

    def check_horizon(self, total_steps: int) -> None:
        """``ValueError`` unless the warmup ends before the decay horizon."""
        horizon = self.decay_steps or total_steps
        if self.warmup_steps and self.warmup_steps >= horizon:
            where = f"optim.decay_steps={self.decay_steps}" if self.decay_steps else f"train.steps={total_steps}"
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be below the decay horizon ({where})")


LR_SCHEDULES = ("constant", "linear", "cosine")
# the OptimizerConfig fields build_optimizer sets itself (optim.extra may set the others)
MOE_RL_OPTIMIZER_FIELDS = frozenset(
    {
        "optimizer",
        "lr",
        "min_lr",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "clip_grad",
        "bf16",
        "params_dtype",
        "use_distributed_optimizer",
    }
)


def wrap_ddp(model: torch.nn.Module, config: TransformerConfig, settings: OptimSettings) -> DistributedDataParallel:
    """megatron-core DDP with fp32 gradient buffers, summed over data-parallel ranks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config.calculate_per_token_loss = True  # DDP then sums instead of averaging
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=shards_optimizer_state(settings),
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
        use_distributed_optimizer=shards_optimizer_state(settings),
        **settings.extra,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks, config_overrides=router_lr_overrides(opt_config, settings))
    choose_adam_kernel(optimizer, fused=settings.fused_adam)
    return optimizer


def router_lr_overrides(opt_config, settings: OptimSettings) -> dict | None:
    """megatron-core's parameter-group overrides (its standard ones: no weight decay on biases
    and norms) plus, for ``router_lr_mult`` != 1, the routers' peak and final learning rates
    scaled; ``None`` (megatron's default, the same standard ones) otherwise."""
    if settings.router_lr_mult == 1.0:
        return None
    from megatron.core.optimizer import ParamKey, get_standard_config_overrides

    overrides = get_standard_config_overrides(opt_config)
    mult = settings.router_lr_mult
    overrides[ParamKey(name="*.router.weight")] = {"max_lr": settings.lr * mult, "min_lr": settings.min_lr * mult}
    return overrides


def shards_optimizer_state(settings: OptimSettings) -> bool:
    """Whether DDP and the optimizer shard state over data-parallel ranks (megatron's
    distributed optimizer): as set, or (``None``) when the dense or the expert
    data-parallel group of this process has more than one rank."""
    if settings.use_distributed_optimizer is not None:
        return settings.use_distributed_optimizer
    from megatron.core import parallel_state

    dense = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return dense > 1 or parallel_state.get_expert_data_parallel_world_size() > 1


def choose_adam_kernel(optimizer: MegatronOptimizer, fused: bool) -> None:
    """megatron-core's fallback Adam (torch's AdamW, without Transformer Engine / apex)
    takes no kernel option and would step CPU parameters one tensor at a time (its
    multi-tensor form only by itself on CUDA): set torch's ``fused`` (one kernel per device
    and dtype, no temporaries) or ``foreach`` on its parameter groups, the public knobs
    read at every step. TE's / apex's fused Adam (no such knobs) is left as it is."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = fused, not fused
            if (
                fused
            ):  # the fused kernel reads each step count on its parameter's device (a loaded one may be on the host)
                for param in group["params"]:
                    state = inner.state.get(param, {})
                    if torch.is_tensor(state.get("step")):
                        state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def build_lr_scheduler(optimizer: MegatronOptimizer, settings: OptimSettings, total_steps: int) -> LRSchedule:
    """megatron-core's scheduler for ``settings`` over a run of ``total_steps`` RL steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    settings.check_horizon(total_steps)
    horizon = settings.decay_steps or total_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=horizon + 1,
        lr_decay_style=settings.lr_schedule,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return LRSchedule(scheduler)


@dataclass
class LRSchedule:
    """The learning rate of each RL step, a function of the step alone (so a resumed run
    continues the schedule exactly): ``set_step(s)`` before step ``s``'s updates (0-based)
    sets every parameter group's rate for it."""

    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler

    def set_step(self, step: int) -> float:
        """Sets the learning rate of step ``step``; returns it as the optimizer holds it."""
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        self.scheduler.num_steps = 0
        self.scheduler.step(step + 1)  # step s at point s + 1 of a horizon + 1 schedule: no step at rate 0
        lr = get_canonical_lr_for_logging(self.scheduler.optimizer.param_groups)
        return float(lr if lr is not None else self.scheduler.get_lr({}))


@dataclass
class StepResult:
    updated: bool
    grad_norm: float
    outputs: list[dict]


def train_step(
    chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    forward_backward: Callable[[], list[dict]],
    biases: list[torch.Tensor] | None = None,
) -> StepResult:
    """Zero gradients, run ``forward_backward`` (e.g. :func:`run_microbatches` with
    ``forward_only=False``), reduce gradients across ranks, clip and step. ``biases``: the
    chunks' :func:`expert_biases` (found here when not given: a walk of every module).

    ``updated`` is False when the gradients held NaN/Inf and the step was skipped."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = forward_backward()
    biases = expert_biases(chunks) if biases is None else biases
    biases_before = [b.clone() for b in biases]
    finalize_model_grads(chunks)  # (also moves routers' expert biases by their load-balancing rule)
    if not _grads_finite(chunks):
        # NaN/Inf anywhere on any rank: skip the update everywhere (weights and expert biases
        # stay as they were)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        with torch.no_grad():
            for bias, before in zip(biases, biases_before):
                bias.copy_(before)
        return StepResult(updated=False, grad_norm=float("nan"), outputs=outputs)
    updated, grad_norm, _ = optimizer.step()
    return StepResult(updated=bool(updated), grad_norm=float(grad_norm or 0.0), outputs=outputs)


def expert_biases(chunks: list[DistributedDataParallel]) -> list[torch.Tensor]:
    """The routers' expert-bias buffers (aux-loss-free balancing), which megatron-core
    updates inside ``finalize_model_grads``."""
    return [b for chunk in chunks for name, b in chunk.module.named_buffers() if name.endswith("router.expert_bias")]


def _grads_finite(chunks: list[DistributedDataParallel]) -> bool:
    """True when no rank holds a NaN/Inf gradient (one device sync, one all-reduce)."""
    from parallel.collectives import any_rank

    # every parameter's main_grad is a view into one of these contiguous buffers; their
    # min and max are finite exactly when every element is (NaN propagates): one read
    # pass, no buffer-sized temporary (isfinite(...).all() takes a bool copy, ~10x slower)
    extremes = [
        value
        for chunk in chunks
        for buffer in chunk.buffers + chunk.expert_parallel_buffers
        for value in torch.aminmax(buffer.grad_data)
    ]
    local_bad = bool(extremes) and not bool(torch.stack(extremes).isfinite().all())
    return not any_rank(local_bad)
