"""parallel.offload.DeviceOffloader: trainer state to host memory and back, in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel.offload import DeviceOffloader


class Stage(torch.nn.Module):
    """Two parameters that are views of one contiguous buffer, with ``main_grad`` views of
    another (as megatron-core's DDP lays them out), and a buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.param_data = torch.randn(10, generator=gen)
        self.grad_data = torch.zeros(10)
        self.w1 = torch.nn.Parameter(self.param_data[:6].view(2, 3))
        self.w2 = torch.nn.Parameter(self.param_data[6:])
        self.w1.main_grad, self.w2.main_grad = self.grad_data[:6].view(2, 3), self.grad_data[6:]
        self.register_buffer("bias", torch.randn(3, generator=gen))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        loss = (self.w1.sum(0) * self.bias).sum() + (self.w2**2).sum()
        optimizer.zero_grad()
        loss.backward()
        for p in (self.w1, self.w2):
            p.main_grad.copy_(p.grad)
        optimizer.step()


def snapshot(stage: Stage, adam: torch.optim.Adam) -> list[torch.Tensor]:
    states = [v.clone() for s in adam.state.values() for v in s.values() if torch.is_tensor(v)]
    return [stage.param_data.clone(), stage.grad_data.clone(), stage.bias.clone(), *states]


def test_round_trip_is_bit_equal_frees_storages_and_keeps_views() -> None:
    stage, twin = Stage(0), Stage(0)
    adam, twin_adam = torch.optim.Adam(stage.parameters(), lr=0.1), torch.optim.Adam(twin.parameters(), lr=0.1)
    stage.step(adam), twin.step(twin_adam)
    offloader = DeviceOffloader([stage], SimpleNamespace(optimizer=adam))  # duck-typed megatron optimizer
    before = snapshot(stage, adam)

    freed = offloader.offload(["grads", "optimizer"])
    assert stage.grad_data.untyped_storage().nbytes() == 0 and stage.param_data.untyped_storage().nbytes() > 0
    assert all(v.untyped_storage().nbytes() == 0 for s in adam.state.values() for v in s.values() if v.dim() > 0)
    assert freed == 2 * 10 * 4 + 2 * 10 * 4  # main_grad and .grad + Adam's two moments; the weights Adam steps stay
    assert offloader.host_bytes == 2 * 10 * 4  # gradients are dropped, not copied
    offloader.offload(["weights"])
    assert stage.param_data.untyped_storage().nbytes() == 0 and stage.bias.untyped_storage().nbytes() == 0
    assert offloader.offloaded() == ["grads", "optimizer", "weights"]

    offloader.onload()
    assert offloader.offloaded() == []
    after = snapshot(stage, adam)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(b, torch.zeros_like(a)) if i == 1 else torch.equal(a, b)  # [1]: the grads come back zeroed
    assert stage.w1.untyped_storage().data_ptr() == stage.param_data.untyped_storage().data_ptr()  # still views
    stage.step(adam), twin.step(twin_adam)  # training goes on exactly as without the round trip
    assert torch.equal(stage.param_data, twin.param_data) and torch.equal(stage.grad_data, twin.grad_data)


def test_later_cycles_reuse_the_host_buffers() -> None:
    stage = Stage(1)
    adam = torch.optim.Adam(stage.parameters(), lr=0.1)
    stage.step(adam)
    offloader = DeviceOffloader([stage], SimpleNamespace(optimizer=adam))
    held = []
    for _ in range(3):
        offloader.offload()
        offloader.onload()
        stage.step(adam)
        held.append(offloader.host_bytes)
    assert held == [held[0]] * 3 and held[0] == (10 + 3 + 2 * 10) * 4  # weights, buffer, Adam's moments


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown state kind"):
        DeviceOffloader([Stage(0)], None).offload(["activations"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_pinned_host_buffers_are_exactly_the_storages_size() -> None:
    """Not torch's caching host allocator (which rounds a block up to a power of two): a
    storage of 3 MiB + 1 byte gets exactly that much pinned memory, copies round-trip."""
    stage = torch.nn.Linear(1, 1).cuda()
    with torch.no_grad():
        # a storage of 3 MiB + 4 bytes
        stage.weight.data = torch.randn(3 * 2**18 + 1, device="cuda").view(-1)[:1].view(1, 1)
    stats = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    before = stage.weight.detach().clone()
    offloader = DeviceOffloader([stage], None)
    offloader.offload(["weights"])
    host = offloader._moved["weights"][0][2]
    assert host.numel() == (3 * 2**18 + 1) * 4 and host.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == stats  # none from the caching allocator
    offloader.onload(["weights"])
    assert torch.equal(stage.weight, before)


def test_pinned_buffers_register_whole_pages_of_their_own(monkeypatch) -> None:
    """CUDA pins whole pages and refuses one registered twice: each buffer registers a
    page-aligned window inside its own allocation, so small buffers allocated side by side
    never share a registered page (checked with a recording stand-in for cudart)."""
    import os

    from parallel import offload

    registered: list[tuple[int, int]] = []

    class Cudart:
        def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
            registered.append((address, size))
            return 0

        def cudaHostUnregister(self, address: int) -> int:
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    page = os.sysconf("SC_PAGE_SIZE")
    buffers = [offload.PinnedHostBuffer(n) for n in (4, 100, page, page + 1, 3 * 2**20 + 1, 16)]
    for buffer, (address, size), n in zip(buffers, registered, (4, 100, page, page + 1, 3 * 2**20 + 1, 16)):
        memory = buffer._memory
        assert buffer.tensor.numel() == n and buffer.tensor.data_ptr() == address
        assert address % page == 0 and size % page == 0 and size >= n
        assert memory.data_ptr() <= address and address + size <= memory.data_ptr() + memory.numel()
    windows = sorted(registered)
    assert all(a + s <= b for (a, s), (b, _) in zip(windows, windows[1:]))  # no page registered twice


def test_host_copies_are_one_allocation_of_aligned_views(monkeypatch) -> None:
    """The host reference's buffers: every tensor's shape and dtype, side by side in one
    allocation (one pinned buffer on CUDA, counted here with a stand-in), none overlapping,
    each starting aligned; values round-trip."""
    from parallel import offload

    like = [torch.randn(3, 5), torch.zeros(0), torch.randn(7).to(torch.bfloat16), torch.tensor(2.0), torch.ones(4, 2)]
    made: list[int] = []

    class Buffer:
        def __init__(self, nbytes: int) -> None:
            made.append(nbytes)
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(offload, "PinnedHostBuffer", Buffer)
    copies = offload.HostCopies(like, pinned=True)
    assert len(made) == 1 and made[0] == sum(-(-t.nbytes // 256) * 256 for t in like)
    assert [(t.shape, t.dtype) for t in copies.tensors] == [(t.shape, t.dtype) for t in like]
    base = copies.tensors[0].untyped_storage().data_ptr()
    spans = []
    for t in copies.tensors:
        assert t.untyped_storage().data_ptr() == base  # one allocation
        start = t.storage_offset() * t.element_size()  # bytes into the allocation
        assert start % 256 == 0
        spans.append((start, start + t.nbytes))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for target, value in zip(copies.tensors, like):
        target.copy_(value)
    assert all(torch.equal(a, b) for a, b in zip(copies.tensors, like))
    assert copies.nbytes == sum(t.nbytes for t in like)
    assert len(offload.HostCopies(like).tensors) == len(like) and len(made) == 1  # CPU: pageable, no pinning
