"""How the trainer's weights reach the rollout engine, chosen once per run.

A :class:`WeightSync` runs on every trainer rank (moving weights is collective: each rank
holds a shard); only the first rank holds the engine (``None`` elsewhere). The trainer
calls :meth:`WeightSync.push` after each step and never asks which engine it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol

from torch import Tensor

from moe_rl.rollout.types import RolloutEngine


class WeightSource(Protocol):
    """The trainer's weights under HF checkpoint names. Both methods are collective."""

    def gather(self) -> dict[str, Tensor] | None:
        """Every full tensor on the first rank; ``None`` on the others."""

    def export(self, path: Path) -> Path:
        """Write a HF directory at ``path`` (each rank writes what it owns)."""


class WeightSync(ABC):
    def __init__(self, engine: RolloutEngine | None) -> None:
        self.engine = engine

    @abstractmethod
    def push(self, weights: WeightSource, version: str) -> None:
        """Collective: after it returns, the engine serves ``weights`` as ``version``."""


class InProcessSync(WeightSync):
    """Full tensors gathered to the first rank, handed to an engine in this process."""

    def push(self, weights: WeightSource, version: str) -> None:
        tensors = weights.gather()
        if self.engine is not None:
            self.engine.update_weights(tensors, version)


class DiskSync(WeightSync):
    """A HF directory every server re-reads (``/update_weights_from_disk``); ``path`` must
    be on a file system the servers see."""

    def __init__(self, engine: RolloutEngine | None, path: Path) -> None:
        super().__init__(engine)
        self.path = Path(path)

    def push(self, weights: WeightSource, version: str) -> None:
        weights.export(self.path)
        if self.engine is not None:
            self.engine.update_weights_from_disk(str(self.path.resolve()), version)
