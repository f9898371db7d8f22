"""What every weight sync is, and what it moves weights from.

A :class:`WeightSync` runs on every trainer rank (moving weights is collective: each rank
holds a shard); only the first rank holds the engine (``None`` elsewhere). The trainer
calls :meth:`WeightSync.push` after each step and never asks which engine it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generic, Protocol, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from moe_rl.models.weight_buckets import Bucket


class WeightSource(Protocol):
    """The trainer's weights under HF checkpoint names. Every method is collective."""

    def gather(self) -> dict[str, Tensor] | None:
        """Every full tensor on the first rank; ``None`` on the others."""

    def send_buckets(
        self, bucket_bytes: int, dtype: torch.dtype | None, consume: Callable[[list[tuple[str, Tensor]]], None] | None
    ) -> int:
        """``consume(bucket)`` on the first rank for each bucket of at most ``bucket_bytes``
        of full tensors (on its device); no rank holds more than a bucket at a time.
        Returns the number of buckets."""

    def stream(
        self,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        consume: Callable[[Bucket, Tensor | None], None] | None,
        *,
        per_stage: bool = False,
        every_rank: bool = False,
    ) -> list[Bucket]:
        """Each bucket packed into one flat byte tensor on its sender (the first rank; with
        ``per_stage`` its pipeline stage's first rank), which calls ``consume(bucket, flat)``;
        the first rank also calls ``consume(bucket, None)`` for the buckets others send
        (``every_rank``: every rank given a ``consume``)."""

    def plan(self, bucket_bytes: int, dtype: torch.dtype | None, *, per_stage: bool = False) -> list[Bucket]:
        """The buckets :meth:`stream` sends, the same on every rank (not collective)."""

    def export(self, path: Path) -> Path:
        """Write a HF directory at ``path`` (each rank writes what it owns)."""


E = TypeVar("E")  # what a sync asks of the engine: one of rollout.contracts' capabilities


class WeightSync(ABC, Generic[E]):
    """Puts the trainer's weights into the rollout engine; ``engine`` (the first rank's,
    ``None`` elsewhere) is held as the capability the sync needs."""

    def __init__(self, engine: E | None) -> None:
        self.engine = engine

    @abstractmethod
    def push(self, weights: WeightSource, version: str) -> None:
        """Collective: after it returns, the engine serves ``weights`` as ``version``."""

    def close(self) -> None:
        """Release what the sync holds (a process group)."""
