"""The old-policy pass of a step: log-probs of the step's micro-batches under the weights
that sampled them (routing recorded for R2, the engine's replayed for R3), with the
train-inference drift observed. The trainer runs it each step; ``moe-rl drift --engine``
runs the same pass on a frozen model."""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from moe_rl.models.forward import MicroBatch
from moe_rl.routing.monitor import RoutingMonitor

Forward = Callable[[Sequence[MicroBatch], list], list[dict]]  # (micro-batches, hooks) -> per micro-batch outputs


def old_policy_pass(
    forward: Forward, batches: Sequence[MicroBatch], monitor: RoutingMonitor | None, *, engine_routing: bool
) -> list[dict]:
    """Collective: ``forward(batches, hooks)`` inside the monitor's old pass (``engine_routing``:
    the batches carry the engine's routed experts, for R3 and the train-vs-rollout drift);
    the rollout log-prob mismatch is added to the monitor (the last stage's log-probs).
    Returns the outputs (empty off the last pipeline stage)."""
    routed = [mb.routed_experts for mb in batches] if engine_routing else None
    with monitor.old_pass(batches, routed) if monitor else contextlib.nullcontext([]) as hooks:
        outputs = forward(batches, hooks)
    if monitor:
        monitor.add_rollout_logp_mismatch([out["logprobs"] for out in outputs] if outputs else None, batches)
    return outputs
