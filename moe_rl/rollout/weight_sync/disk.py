"""Weights through a HF directory that every SGLang server re-reads."""

from __future__ import annotations

from pathlib import Path

from moe_rl.rollout.types import RolloutEngine
from moe_rl.rollout.weight_sync.base import WeightSource, WeightSync


class DiskSync(WeightSync[RolloutEngine]):
    """A HF directory every server re-reads (``/update_weights_from_disk``); ``path`` must
    be on a file system the servers see."""

    def __init__(self, engine: RolloutEngine | None, path: Path) -> None:
        super().__init__(engine)
        self.path = Path(path)

    def push(self, weights: WeightSource, version: str) -> None:
        weights.export(self.path)
        if self.engine is not None:
            self.engine.update_weights_from_disk(str(self.path.resolve()), version)
