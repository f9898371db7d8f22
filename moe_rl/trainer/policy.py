"""The models a run trains and consults: this rank's stage of the policy (with its DDP
wrapper and optimizer) and of the frozen reference policy."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from transformers import PretrainedConfig

from moe_rl.models.builder import build_model, make_transformer_config, named_weights
from moe_rl.models.forward import ForwardHooks, LossFn, MicroBatch, run_microbatches
from moe_rl.models.hf_weights import load_hf_weights
from moe_rl.models.layers import LayerModules
from moe_rl.models.weight_buckets import HFWeights
from moe_rl.models.logprob_head import LogProbConfig
from moe_rl.routing.replay import replay_config_overrides
from parallel.layout import ParallelLayout
from parallel.offload import HostCopies
from parallel.optim import (
    LRSchedule,
    OptimSettings,
    StepResult,
    build_lr_scheduler,
    build_optimizer,
    expert_biases,
    train_step,
    wrap_ddp,
)

FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@dataclass
class Policy:
    """This rank's pipeline stage of the trained model."""

    model: GPTModel
    ddp: DistributedDataParallel
    optimizer: MegatronOptimizer
    lr_schedule: LRSchedule
    hf_config: PretrainedConfig
    optim_settings: OptimSettings  # what built the optimizer (checkpoints record its kind)

    @functools.cached_property
    def weights(self) -> HFWeights:
        return HFWeights(self.model, self.hf_config)

    @functools.cached_property
    def expert_biases(self) -> list[torch.Tensor]:
        """The routers' expert-bias buffers (found once; megatron moves them in place)."""
        return expert_biases([self.ddp])

    def logprobs(self, batches: Sequence[MicroBatch], hooks: Sequence[ForwardHooks] = ()) -> list[dict]:
        """Forward only: per micro-batch ``logprobs`` / ``entropy`` (last stage)."""
        return run_microbatches([self.ddp], list(batches), hooks=hooks)

    def update(self, batches: Sequence[MicroBatch], loss_fn: LossFn, hooks: Sequence[ForwardHooks] = ()) -> StepResult:
        """One optimizer step on the summed loss of ``batches`` (skipped on NaN/Inf)."""
        return train_step(
            [self.ddp],
            self.optimizer,
            lambda: run_microbatches([self.ddp], list(batches), loss_fn=loss_fn, forward_only=False, hooks=hooks),
            self.expert_biases,
        )


def build_policy(
    hf_config: PretrainedConfig,
    hf_dir: str,
    layout: ParallelLayout,
    optim: OptimSettings,
    *,
    total_steps: int,
    replay: str,
    recompute_activations: bool,
    logprob_config: LogProbConfig,
    expert_bias_update_rate: float = 1e-3,
    modules: LayerModules = LayerModules(),
) -> Policy:
    """The policy's stage with ``hf_dir``'s weights, megatron DDP, the optimizer and its
    learning-rate schedule over ``total_steps`` RL steps. Routers with an expert bias move
    it by ``expert_bias_update_rate`` per optimizer step (megatron-core's rule); experts
    and attention are built as ``modules`` says."""
    overrides = {
        **replay_config_overrides(replay),
        **(FULL_RECOMPUTE if recompute_activations else {}),
        "moe_router_bias_update_rate": expert_bias_update_rate,
    }
    config = make_transformer_config(hf_config, layout, modules=modules, **overrides)
    model = build_model(hf_config, config, logprob_config, modules)
    load_hf_weights(model, hf_config, hf_dir)
    ddp = wrap_ddp(model, config, optim)
    optimizer = build_optimizer([ddp], optim)
    return Policy(model, ddp, optimizer, build_lr_scheduler(optimizer, optim, total_steps), hf_config, optim)


def build_reference(
    hf_config: PretrainedConfig,
    hf_dir: str,
    layout: ParallelLayout,
    logprob_config: LogProbConfig,
    modules: LayerModules = LayerModules(),
) -> GPTModel:
    """A frozen copy of the starting policy's stage (for the KL penalty)."""
    model = build_model(hf_config, make_transformer_config(hf_config, layout, modules=modules), logprob_config, modules)
    load_hf_weights(model, hf_config, hf_dir)
    return model.eval()


class Reference(Protocol):
    """The frozen starting policy's log-probs (for the KL penalty)."""

    def logprobs(self, batches: Sequence[MicroBatch]) -> list[dict]: ...


@dataclass
class DeviceReference:
    """A second, frozen model stage on the device (fast; costs a model's memory)."""

    model: GPTModel

    def logprobs(self, batches: Sequence[MicroBatch]) -> list[dict]:
        return run_microbatches(self.model, list(batches))


@dataclass
class HostReference:
    """The starting weights of this rank's stage kept in host memory and swapped into the
    policy's own parameters for the reference pass, then swapped back (as slime does): no
    second model on the device, three host-device copies of the stage per step into buffers
    allocated once (two stages of host memory, pinned on CUDA: one registered buffer each),
    one stream sync per swap. The optimizer's state is not touched; routers' expert biases
    are swapped too."""

    policy: Policy
    weights: HostCopies  # in ``named_weights(policy.model)`` order
    trained: HostCopies  # where the policy's weights wait during the pass

    @classmethod
    def snapshot(cls, policy: Policy) -> HostReference:
        """The policy's current (starting) weights."""
        params = [p for _, p in named_weights(policy.model)]
        weights, trained = HostCopies(params), HostCopies(params)
        _load_into(weights.tensors, params)
        return cls(policy, weights, trained)

    def logprobs(self, batches: Sequence[MicroBatch]) -> list[dict]:
        params = [p for _, p in named_weights(self.policy.model)]
        _load_into(self.trained.tensors, params)
        try:
            _load_into(params, self.weights.tensors)
            return self.policy.logprobs(batches)
        finally:
            _load_into(params, self.trained.tensors)


def _load_into(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Copies queued on the stream and waited for once (pinned memory: asynchronous)."""
    with torch.no_grad():
        for target, value in zip(targets, values, strict=True):
            target.copy_(value, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def build_reference_for(
    policy: Policy,
    mode: str,
    hf_dir: str,
    layout: ParallelLayout,
    logprob_config: LogProbConfig,
    modules: LayerModules = LayerModules(),
) -> Reference:
    """``algorithm.reference``: ``host`` (swapped into the policy) or ``device`` (a second
    model, built of the policy's ``modules``)."""
    if mode == "host":
        return HostReference.snapshot(policy)
    return DeviceReference(build_reference(policy.hf_config, hf_dir, layout, logprob_config, modules))
