"""Trainer state out of device memory and back, in place, for colocated rollouts.

When SGLang shares the trainer's GPUs (``rollout.colocate``), the trainer's weights,
gradient buffers and optimizer state must leave the GPU while the engine generates.
:class:`DeviceOffloader` copies each tensor *storage* to host memory (pinned on CUDA: host
memory of exactly the storage's size registered with CUDA, not torch's caching host
allocator, which rounds every block up to a power of two: ~25-50% more pinned RAM) and
shrinks the storage to zero bytes; reloading grows it back and copies the bytes in. Every
view of a storage (megatron-core's parameters and ``main_grad`` are views into DDP's
contiguous buffers, the distributed optimizer's shards are views too) stays valid, so no
module, buffer or optimizer needs to know. Gradients are not copied: the next step zeroes
them first, so they are freed and come back as zeros. On CPU the copy is real but frees nothing
useful (host to host); it is what the tests check (bit-equal round trip, storages freed).
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, Sequence

import torch
from megatron.core.optimizer import MegatronOptimizer

KINDS = ("weights", "grads", "optimizer")
# the next training step zeroes the gradient buffers before anything reads them: their
# storages are freed without a copy and come back as zeros
DISCARDED = frozenset({"grads"})


class DeviceOffloader:
    """Offloads and reloads ``kind`` s of state of ``modules`` and ``optimizer``.

    Host buffers (pinned on CUDA) are allocated on the first offload and reused by every
    later one (pinned allocations are slow and fragment host memory), so the host keeps
    one copy of the offloaded state for the whole run."""

    def __init__(self, modules: Iterable[torch.nn.Module], optimizer: MegatronOptimizer | None) -> None:
        self.modules = list(modules)
        self.optimizer = optimizer
        # per kind: (storage, its size, its host copy or None when discarded)
        self._moved: dict[str, list[tuple[torch.UntypedStorage, int, torch.Tensor | None]]] = {}
        self._spare: dict[int, list[torch.Tensor]] = {}  # free host buffers by size
        self._pinned: list[PinnedHostBuffer] = []  # every pinned buffer (registered until the offloader goes)

    def offloaded(self) -> list[str]:
        return sorted(self._moved)

    @property
    def host_bytes(self) -> int:
        """Host memory this offloader holds (its buffers, in use or spare)."""
        in_use = sum(host.numel() for saved in self._moved.values() for _, _, host in saved if host is not None)
        return in_use + sum(host.numel() for spare in self._spare.values() for host in spare)

    def offload(self, kinds: Iterable[str] = KINDS) -> int:
        """Move ``kinds`` to host memory (``DISCARDED`` kinds are only freed); returns the
        bytes freed on the device."""
        freed = 0
        for kind in _checked(kinds):
            if kind in self._moved:
                continue
            saved = []
            for storage in _unique(self._tensors(kind)):
                host = None if kind in DISCARDED else self._host_buffer(storage)
                if host is not None:
                    host.copy_(_bytes_of(storage), non_blocking=True)
                saved.append((storage, storage.nbytes(), host))
            _synchronize([storage for storage, _, _ in saved])
            for storage, nbytes, _ in saved:
                freed += nbytes
                storage.resize_(0)
            self._moved[kind] = saved
        if freed and torch.cuda.is_available():
            # the freed blocks stay in this process's caching allocator until emptied: a
            # colocated SGLang server could not have them back; blocks handed to it by CUDA
            # IPC (the tensor sync's buckets) are kept until collected once it let them go
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return freed

    def onload(self, kinds: Iterable[str] = KINDS) -> None:
        """Bring ``kinds`` back (each storage regrown and refilled in place)."""
        for kind in _checked(kinds):
            for storage, nbytes, host in self._moved.pop(kind, []):
                storage.resize_(nbytes)
                if host is None:
                    _bytes_of(storage).zero_()
                else:
                    _bytes_of(storage).copy_(host, non_blocking=True)
                    self._spare.setdefault(nbytes, []).append(host)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    def _host_buffer(self, storage: torch.UntypedStorage) -> torch.Tensor:
        spare = self._spare.get(storage.nbytes())
        if spare:
            return spare.pop()
        if storage.device.type != "cuda":
            return torch.empty(storage.nbytes(), dtype=torch.uint8)
        self._pinned.append(PinnedHostBuffer(storage.nbytes()))
        return self._pinned[-1].tensor

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
                for (
                    group
                ) in inner.param_groups:  # fp32 main copies of low-precision weights (not the weights themselves)
                    yield from (p for p in group["params"] if p.untyped_storage().data_ptr() not in weights)
                for state in inner.state.values():
                    yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


class PinnedHostBuffer:
    """``nbytes`` of page-locked host memory, to the page: pageable memory registered with
    CUDA (``cudaHostRegister``; copies to and from it run asynchronously, as from memory
    torch pins itself), unregistered when this object goes (before the memory is freed).
    CUDA pins whole pages and refuses a page registered twice, so the registered window is
    the page-aligned span inside an allocation of ``nbytes`` plus two pages: it shares no
    page with another allocation (small ones come from the heap, side by side)."""

    def __init__(self, nbytes: int) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        span = -(-nbytes // page) * page
        self._memory = torch.empty(span + 2 * page, dtype=torch.uint8)
        start = -self._memory.data_ptr() % page  # the first page boundary inside the allocation
        self.tensor = self._memory[start : start + nbytes]
        self._address = self._memory.data_ptr() + start if nbytes else 0
        if self._address:
            _check_cuda(
                torch.cuda.cudart().cudaHostRegister(self._address, span, 0), f"pinning {nbytes} bytes of host memory"
            )

    def __del__(self) -> None:
        if self._address:
            torch.cuda.cudart().cudaHostUnregister(self._address)
            self._address = 0


class HostCopies:
    """Host tensors shaped like ``like`` (shapes and dtypes), all in one allocation: one
    :class:`PinnedHostBuffer` on CUDA (``pin_memory=True`` per tensor would round each up to
    a power of two: up to twice the memory, and one registration per tensor), pageable
    memory elsewhere. Each tensor starts at a multiple of ``ALIGN`` bytes."""

    ALIGN = 256

    def __init__(self, like: Sequence[torch.Tensor], *, pinned: bool | None = None) -> None:
        sizes = [t.numel() * t.element_size() for t in like]
        offsets = [0]
        for nbytes in sizes:
            offsets.append(offsets[-1] + -(-nbytes // self.ALIGN) * self.ALIGN)
        pinned = torch.cuda.is_available() if pinned is None else pinned
        self._pinned = PinnedHostBuffer(offsets[-1]) if pinned else None  # registered while this lives
        memory = self._pinned.tensor if self._pinned is not None else torch.empty(offsets[-1], dtype=torch.uint8)
        self.tensors = [
            memory[start : start + nbytes].view(t.dtype).view(t.shape) for t, start, nbytes in zip(like, offsets, sizes)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A byte tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _check_cuda(status, what: str) -> None:
    code = int(getattr(status, "value", status))
    if code != 0:
        raise RuntimeError(f"{what} failed: CUDA error {code}")


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


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    if any(storage.device.type == "cuda" for storage in storages):
        torch.cuda.synchronize()
