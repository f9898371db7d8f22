"""Weights handed to an engine that runs in this process (the local engine)."""

from __future__ import annotations

from moe_rl.rollout.contracts import InProcessWeightReceiver, require_capability
from moe_rl.rollout.types import RolloutEngine
from moe_rl.rollout.weight_sync.base import WeightSource, WeightSync


class InProcessSync(WeightSync[InProcessWeightReceiver]):
    """Full tensors gathered to the first rank, handed to an engine in this process."""

    def __init__(self, engine: RolloutEngine | None) -> None:
        super().__init__(require_capability(engine, InProcessWeightReceiver, "an in-process weight sync"))

    def push(self, weights: WeightSource, version: str) -> None:
        tensors = weights.gather()
        if self.engine is not None:
            assert tensors is not None  # (the first rank gathers them)
            self.engine.update_weights(tensors, version)
