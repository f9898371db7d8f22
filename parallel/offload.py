"""Trainer state out of device memory and back, in place, for colocated rollouts.

When SGLang shares the trainer's GPUs (``rollout.colocate``), the trainer's weights,
gradient buffers and optimizer state must leave the GPU while the engine generates.
:class:`DeviceOffloader` copies each tensor *storage* to host memory (pinned on CUDA) and
shrinks the storage to zero bytes; reloading grows it back and copies the bytes in. Every
view of a storage (megatron-core's parameters and ``main_grad`` are views into DDP's
contiguous buffers, the distributed optimizer's shards are views too) stays valid, so no
module, buffer or optimizer needs to know. On CPU the copy is real but frees nothing
useful (host to host); it is what the tests check (bit-equal round trip, storages freed).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from megatron.core.optimizer import MegatronOptimizer

KINDS = ("weights", "grads", "optimizer")


class DeviceOffloader:
    """Offloads and reloads ``kind`` s of state of ``modules`` and ``optimizer``."""

    def __init__(self, modules: Iterable[torch.nn.Module], optimizer: MegatronOptimizer | None) -> None:
        self.modules = list(modules)
        self.optimizer = optimizer
        self._host: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}

    def offloaded(self) -> list[str]:
        return sorted(self._host)

    def offload(self, kinds: Iterable[str] = KINDS) -> int:
        """Move ``kinds`` to host memory; returns the bytes freed on the device."""
        freed = 0
        for kind in _checked(kinds):
            if kind in self._host:
                continue
            saved = []
            for storage in _unique(self._tensors(kind)):
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                host.untyped_storage().copy_(storage, non_blocking=True)
                saved.append((storage, host))
            _synchronize(saved)
            for storage, _ in saved:
                freed += storage.nbytes()
                storage.resize_(0)
            self._host[kind] = saved
        return freed

    def onload(self, kinds: Iterable[str] = KINDS) -> None:
        """Bring ``kinds`` back (each storage regrown and refilled in place)."""
        for kind in _checked(kinds):
            for storage, host in self._host.pop(kind, []):
                storage.resize_(host.numel())
                storage.copy_(host.untyped_storage(), non_blocking=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    def _tensors(self, kind: str) -> Iterator[torch.Tensor]:
        if kind == "weights":
            for module in self.modules:
                yield from module.parameters()
                yield from module.buffers()
        elif kind == "grads":
            for module in self.modules:
                for p in module.parameters():
                    for grad in (getattr(p, "main_grad", None), p.grad):
                        if grad is not None:
                            yield grad
        elif self.optimizer is not None:
            weights = {t.untyped_storage().data_ptr() for t in self._tensors("weights")}
            for inner in _torch_optimizers(self.optimizer):
                for group in inner.param_groups:  # fp32 main copies of low-precision weights (not the weights themselves)
                    yield from (p for p in group["params"] if p.untyped_storage().data_ptr() not in weights)
                for state in inner.state.values():
                    yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained or not)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for part in chained for inner in _torch_optimizers(part)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            seen.setdefault((str(storage.device), storage.data_ptr()), storage)
    return list(seen.values())


def _checked(kinds: Iterable[str]) -> list[str]:
    kinds = list(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown state kind(s) {bad}; valid: {', '.join(KINDS)}")
    return kinds


def _synchronize(saved) -> None:
    if any(storage.device.type == "cuda" for storage, _ in saved):
        torch.cuda.synchronize()
