"""Small collectives the trainer needs, on the process group's device (``cuda:<local
rank>`` under NCCL, CPU under gloo), and the rank facts it asks about. Every function
works in a one-process world without a process group."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def rank_device() -> torch.device:
    """This rank's device: its CUDA device when there is one, else the CPU bridge's
    device (the CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    from parallel import cpu_bridge

    return cpu_bridge.device()


def peak_memory_mb() -> float:
    """This rank's peak memory so far: CUDA memory allocated on its device, else the
    process's peak resident set (which includes everything the process holds)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(rank_device()) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_first_rank() -> bool:
    return rank() == 0


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` from rank ``src`` on every rank (pickled)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=rank_device())
    return box[0]


def gather_objects(obj: T, dst: int = 0) -> list[T] | None:
    """Every rank's ``obj`` on rank ``dst`` (in rank order); ``None`` elsewhere."""
    if not _distributed():
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def all_gather_objects(obj: T) -> list[T]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce(values: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """``values`` reduced over ``group`` (default: every rank) with ``op`` in sum | max | min;
    the collective runs on the group's device, the result comes back where ``values`` was."""
    if not _distributed() or (group is not None and dist.get_world_size(group) == 1):
        return values
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    work = values.to(rank_device())
    dist.all_reduce(work, op=reduce_op, group=group)
    return work.to(values.device)


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank."""
    return bool(all_reduce(torch.tensor([float(flag)]), op="max").item())


def barrier() -> None:
    if _distributed():
        dist.barrier()


def send_tensors(tensors: list[torch.Tensor], dst: int) -> None:
    """Send ``tensors`` (dense, on this rank's device) to rank ``dst``, which calls
    :func:`recv_tensors` with tensors of the same shapes and types, in order.

    Batched point to point: NCCL runs a batch on the group's own communicator, while a
    single ``dist.send`` opens a two-rank communicator per pair of ranks (buffers and a
    setup each; on 2x8 GPUs, 15 of them on the first rank alone)."""
    send_tensors_to([(dst, tensors)])


def send_tensors_to(messages: Sequence[tuple[int, list[torch.Tensor]]]) -> None:
    """:func:`send_tensors` of each ``(dst, tensors)`` in one batch: the transfers to the
    ranks overlap (each receiver calls :func:`recv_tensors` as for one send)."""
    _point_to_point([(dist.isend, tensor, dst) for dst, tensors in messages for tensor in tensors])


def recv_tensors(tensors: list[torch.Tensor], src: int) -> None:
    """Fill ``tensors`` from rank ``src``'s :func:`send_tensors`."""
    _point_to_point([(dist.irecv, tensor, src) for tensor in tensors])


def _point_to_point(operations: list[tuple[Any, torch.Tensor, int]]) -> None:
    # empty tensors are left out on both sides (their shapes match): nothing to move, and no
    # zero-length operation for NCCL to treat its own way
    ops = [dist.P2POp(op, tensor, peer) for op, tensor, peer in operations if tensor.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# ------------------------------------------------------------------ megatron's groups


def data_parallel_share(count: int) -> tuple[list[int], int]:
    """The indices of ``count`` items this data-parallel rank handles (round robin), and
    the largest share any rank has (``ceil(count / dp)``)."""
    from megatron.core import parallel_state as ps

    size = ps.get_data_parallel_world_size()
    return list(range(ps.get_data_parallel_rank(), count, size)), -(-count // size)


def data_parallel_position() -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size); (0, 1) without megatron's groups."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def reports_loss() -> bool:
    """Exactly one rank per data-parallel replica holds the loss outputs: the last pipeline
    stage's tensor-parallel rank 0."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():  # one process, no model-parallel groups
        return True
    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()
