"""A step's routing passes and the old-policy pass.

:class:`StepRouting` puts together what a run asked for: routing replay (R2/R3, which
changes the forward: :class:`~moe_rl.routing.step_replay.StepReplay`) and the drift
metrics (which only observe: :class:`~moe_rl.routing.monitor.RoutingMonitor`), one context
per pass yielding both parts' hooks. :func:`old_policy_pass` is the old-policy pass of a
step: log-probs under the weights that sampled the batch, with the train-inference routing
drift observed (the log-prob mismatch is measured from them by
:mod:`moe_rl.trainer.rollout_mismatch`). The trainer runs it each step; ``moe-rl drift
--engine`` runs the same pass on a frozen model."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from moe_rl.trainer.batch import PolicyMicroBatch
from moe_rl.routing.monitor import RoutingMonitor
from moe_rl.routing.step_replay import StepReplay, engine_indices, engine_routed_positions

Forward = Callable[[Sequence[PolicyMicroBatch], list], list[dict]]  # (micro-batches, hooks) -> per micro-batch outputs


@dataclass
class StepRouting:
    """A run's routing parts (either may be ``None``) over ``model``'s MoE layers."""

    model: torch.nn.Module
    num_experts: int
    replay: StepReplay | None = None  # changes the forward (R2/R3)
    monitor: RoutingMonitor | None = None  # observes it (drift metrics)

    @contextlib.contextmanager
    def old_pass(self, batches: Sequence[PolicyMicroBatch], engine_routing: bool) -> Iterator[list]:
        """``engine_routing``: the batches carry the engine's routed experts (R3 replays them,
        the monitor compares with them)."""
        routed = _engine_routing(batches) if engine_routing else None
        indices = engine_indices(self.model, batches, routed, self.num_experts) if routed is not None else None
        with contextlib.ExitStack() as passes:
            if self.monitor:
                positions = engine_routed_positions(batches, routed) if routed is not None else None
                hooks = passes.enter_context(self.monitor.old_pass(batches, indices, positions))
            else:
                hooks = []
            if self.replay:  # last: the probe reads what the replayed router chose
                hooks = hooks + passes.enter_context(self.replay.old_pass(indices))
            yield hooks

    @contextlib.contextmanager
    def update_pass(self) -> Iterator[list]:
        """One policy-update pass (forward and backward)."""
        with contextlib.ExitStack() as passes:
            hooks = passes.enter_context(self.monitor.update_pass()) if self.monitor else []
            if self.replay:
                hooks = hooks + passes.enter_context(self.replay.update_pass())
            yield hooks

    def release(self) -> None:
        """The step's routing state freed (after the monitor's reduce): replay indices, the
        monitor's routing and statistics (at Qwen3-30B-A3B's shape ~1.3 KB a trained token
        per rank, else held through the next rollout)."""
        if self.replay:
            self.replay.release()
        if self.monitor:
            self.monitor.release()

    @contextlib.contextmanager
    def after_update_pass(self, bias_before: dict[int, Tensor] | None = None) -> Iterator[list]:
        """The monitor's forward-only pass after the optimizer step (no replay)."""
        watched: contextlib.AbstractContextManager[list] = (
            self.monitor.after_update_pass(bias_before) if self.monitor else contextlib.nullcontext([])
        )
        with watched as hooks:
            yield hooks


def _engine_routing(batches: Sequence[PolicyMicroBatch]) -> list[list[Tensor | None]]:
    """Each micro-batch's sequences' routed experts from the engine, row for row; ``None``
    for a sample without any (a response of no tokens, whose routing nothing trained on
    depends on: SGLang returns none for it). A batch without any is the engine's
    configuration, the same on every rank, so raising there stops every rank alike."""
    routed = []
    for mb in batches:
        if mb.routed_experts is None:
            raise ValueError("the rollout engine returned no routed experts for the step's samples")
        routed.append(list(mb.routed_experts))
    return routed


def old_policy_pass(
    forward: Forward, batches: Sequence[PolicyMicroBatch], routing: StepRouting | None, *, engine_routing: bool
) -> list[dict]:
    """Collective: ``forward(batches, hooks)`` inside the routing's old pass (``engine_routing``:
    the batches carry the engine's routed experts, for R3 and the train-vs-rollout drift).
    Returns the outputs (empty off the last pipeline stage)."""
    old_pass: contextlib.AbstractContextManager[list] = (
        routing.old_pass(batches, engine_routing) if routing else contextlib.nullcontext([])
    )
    with old_pass as hooks:
        outputs = forward(batches, hooks)
    return outputs
