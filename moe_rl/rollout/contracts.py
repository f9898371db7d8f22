"""What a weight sync or a placement asks of a rollout engine, one ``Protocol`` per
capability. Every engine is a :class:`~moe_rl.rollout.types.RolloutEngine` (generate, load a
HF directory); an engine declares the rest by inheriting these (the SGLang client
implements all of them, the local engine takes weights in process). The builders check an
engine against the capability its sync or placement needs once, when the run starts."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class InProcessWeightReceiver(Protocol):
    """Takes full weights by HF checkpoint names from this process."""

    def update_weights(self, hf_tensors: Mapping[str, Tensor], weight_version: str) -> None: ...


@runtime_checkable
class WeightUpdateSession(Protocol):
    """Updates weights between a begin and an end (generation paused in between)."""

    def weight_update(self, weight_version: str) -> contextlib.AbstractContextManager[None]:
        """Inside: generation paused and weights may be sent; after it, every server is
        labelled ``weight_version`` and reports it (after a failure: not that version)."""
        ...

    def supports_flattened_buckets(self) -> bool:
        """Every server takes a bucket as one flat byte buffer (else one tensor at a time)."""
        ...

    def server_ranks(self) -> list[int]:
        """The ranks each server has (its TP size): in a weight-update group, or the payloads
        a tensor update hands it."""
        ...

    def server_urls(self) -> list[str]:
        """Its servers, in the order of :meth:`server_ranks` (for log lines and errors)."""
        ...


@runtime_checkable
class DistributedWeightReceiver(WeightUpdateSession, Protocol):
    """Receives broadcasts over a weight-update group its server ranks join."""

    def server_nccl_versions(self) -> list[str | None]:
        """Each server's NCCL version (``"2.27.7"``), ``None`` where it cannot be known (a
        server this run did not start: SGLang does not report it)."""
        ...

    def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, join: Callable[[int], Any]
    ) -> Any:
        """Every server rank joins ``group_name`` while ``join(world_size)`` makes this
        process its rank 0; returns what ``join`` returns."""
        ...

    def destroy_weights_update_group(self, group_name: str) -> None: ...

    def update_weights_from_distributed(
        self,
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        broadcast: Callable[[], None],
        *,
        group_name: str,
        flattened: bool = False,
    ) -> None:
        """Announce ``tensors`` (name, dtype, shape), then ``broadcast()`` them over ``group_name``
        (inside :meth:`weight_update`, which labels the weights once all have arrived)."""
        ...


@runtime_checkable
class TensorWeightReceiver(WeightUpdateSession, Protocol):
    """Takes buckets by reference (CUDA IPC handles; shared-memory files on CPU)."""

    def update_weights_from_tensor(self, serialized: str | Sequence[Sequence[str]], *, flattened: bool = False) -> None:
        """``serialized[s][i]``: what TP rank i of server s maps (or one for all of them);
        inside :meth:`weight_update`, which labels the weights once all have arrived."""
        ...


@runtime_checkable
class MemoryReleaser(Protocol):
    """Frees and takes back its GPU memory by kind (a colocated trainer's turn)."""

    def release_memory_occupation(self, tags: Sequence[str]) -> None: ...

    def resume_memory_occupation(self, tags: Sequence[str]) -> None: ...


C = TypeVar("C")


def require_capability(engine: object, capability: type[C], what: str) -> C | None:
    """``engine``, which must implement ``capability`` (``None``, off the first rank, always
    passes), as one; else a ``TypeError`` naming what needed it."""
    if engine is None:
        return None
    if not isinstance(engine, capability):
        raise TypeError(f"{what} needs an engine that is a {capability.__name__}; {type(engine).__name__} is not")
    return engine
