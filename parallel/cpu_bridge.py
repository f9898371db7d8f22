# mypy: disable-error-code="assignment,method-assign,misc,return-value"
# (this module's job is to put CPU stand-ins in torch.cuda's and torch.Tensor's places)
"""Run megatron-core on a machine without CUDA.

megatron-core assumes a CUDA device in a few places that have nothing to do with the
math: ``torch.cuda.current_device()`` used as a device, CUDA streams and events, the
model-parallel RNG tracker's CUDA generator, literal ``device="cuda"`` tensors, a
Transformer-Engine symbol that is undefined without TE, split sizes that must be host
lists, ``torch.cuda.*Tensor`` type-name checks in the optimizer, and gloo's refusal of
unequal all_gather sizes. :func:`install` bridges each of them onto the CPU once,
refuses what NCCL refuses and gloo silently gets wrong (a strided tensor in a collective),
and returns an all_reduce over a one-rank group at once (gloo's costs 30-140 us).

It is installed by :func:`parallel.distributed.init_distributed` only when
``torch.cuda.is_available()`` is false; GPU runs never load this module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

_INSTALLED = False
_DEVICE = torch.device("cpu")  # where bridged CUDA calls put their tensors


def is_installed() -> bool:
    return _INSTALLED


def device() -> torch.device:
    """The device that stands for "the GPU" once the bridge is installed: the CPU, or
    another non-CUDA device given to :func:`install` (tests run the trainer on a
    stand-in accelerator to catch a CPU tensor meeting a device tensor)."""
    return _DEVICE


def install(device: torch.device | str = "cpu") -> None:
    """Bridge megatron-core's CUDA assumptions onto ``device`` (idempotent)."""
    global _INSTALLED, _DEVICE
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU bridge is for machines without CUDA; this one has a CUDA device")
    _DEVICE = torch.device(device)
    _patch_torch_cuda()
    _patch_megatron()
    _patch_uneven_collectives()
    _return_one_rank_all_reduce_at_once()
    _refuse_strided_collectives()
    _patch_devices()
    _run_compiled_helpers_eagerly()
    _INSTALLED = True


# ----------------------------------------------------------------- torch.cuda


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":
        return event or _NullEvent()

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _DEVICE
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.ipc_collect = lambda: None
    # the model-parallel RNG tracker keeps its states in "the CUDA generator": use the CPU one
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.Tensor.record_stream = lambda self, stream: None


def _run_compiled_helpers_eagerly() -> None:
    """megatron-core wraps small elementwise helpers (the router's expert-bias update, the
    experts' activation) in ``torch.compile`` to fuse CUDA kernels. On a CPU that buys
    nothing and costs a C++ compile of each at its first call and again at a new input
    shape (0.1-0.4 s a time, within the first training steps); run them as written."""
    torch.compiler.set_stance("force_eager")


# ----------------------------------------------------------------- megatron-core


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # the tracker warns when the CPU generator moves inside fork(); on CPU that generator
    # *is* the forked one, so the warning is expected and silenced (only this message)
    logging.getLogger(mp_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )

    # split sizes must be host lists for all_to_all_single: the original returns tensors
    # that are not CUDA tensors untouched even when numpy was asked for
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out):
            return out.cpu().numpy()
        return out

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # dist_checkpointing's fully parallel load makes each shard a rank receives with
    # ShardedTensor.init_data("cuda"), whose default torch.empty was bound before the
    # factories were bridged
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    init_data = ShardedTensor.init_data

    @functools.wraps(init_data)
    def init_data_on_the_device(self, device, init_fn=None):
        return init_data(self, _DEVICE if _is_cuda(device) else device, init_fn or torch.empty)

    ShardedTensor.init_data = init_data_on_the_device


# ----------------------------------------------------------------- gloo collectives


class _DoneWork:
    """What an ``async_op=True`` collective returns once it has already completed."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _patch_uneven_collectives() -> None:
    """gloo's all_gather / reduce_scatter reject unequal sizes, which megatron uses with
    expert-tensor parallelism (EP > 1, ETP > 1): pad -> all_gather -> trim, and
    all_reduce -> take this rank's slice."""
    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    @functools.wraps(all_gather)
    def uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        buffers = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(buffers, padded, group=group)
        for out, buf in zip(tensor_list, buffers):
            out.copy_(buf[: out.shape[0]])
        return _DoneWork() if async_op else None

    @functools.wraps(reduce_scatter)
    def uneven_reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if all(t.shape == output.shape for t in input_list):
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(flat[start : start + output.numel()].view_as(output))
        return _DoneWork() if async_op else None

    dist.all_gather = uneven_all_gather
    dist.reduce_scatter = uneven_reduce_scatter


# the reductions whose result over one rank is that rank's tensor as it is (not PREMUL_SUM)
_IDENTITY_ON_ONE_RANK = (
    dist.ReduceOp.SUM,
    dist.ReduceOp.AVG,
    dist.ReduceOp.MAX,
    dist.ReduceOp.MIN,
    dist.ReduceOp.PRODUCT,
    dist.ReduceOp.BAND,
    dist.ReduceOp.BOR,
    dist.ReduceOp.BXOR,
)


def _return_one_rank_all_reduce_at_once() -> None:
    """An all_reduce over a one-rank group leaves the tensor as it is; gloo still copies it
    through its own buffers and hands it to a worker thread (30-140 us a call, the gradient
    buffers' sync and the grad norm's each step of a single-process run). Return at once
    there. (Installed under the strided-tensor refusal, which still checks the tensor.)"""
    all_reduce = dist.all_reduce

    @functools.wraps(all_reduce)
    def one_rank_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op in _IDENTITY_ON_ONE_RANK and dist.get_world_size(group) == 1:
            return _DoneWork() if async_op else None
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = one_rank_all_reduce


# the collectives' tensor arguments that NCCL checks to be dense (ProcessGroupNCCL's
# check_gpu_single_tensor): positional index and keyword name (isend / irecv stay as they
# are: P2POp accepts only those very functions; batch_isend_irecv checks their tensors)
_DENSE_ARGUMENTS = {
    "broadcast": ((0, "tensor"),),
    "all_reduce": ((0, "tensor"),),
    "reduce": ((0, "tensor"),),
    "send": ((0, "tensor"),),
    "recv": ((0, "tensor"),),
    "all_gather": ((1, "tensor"),),
    "reduce_scatter": ((0, "output"),),
    "all_gather_into_tensor": ((0, "output_tensor"), (1, "input_tensor")),
    "reduce_scatter_tensor": ((0, "output"), (1, "input")),
    "all_to_all_single": ((0, "output"), (1, "input")),
}


def _refuse_strided_collectives() -> None:
    """NCCL refuses a strided tensor ("Tensors must be contiguous"); gloo reads and writes
    one as if it were dense, silently wrong. Refuse it here as NCCL does, so that CPU runs
    fail where GPU runs would."""
    for name, arguments in _DENSE_ARGUMENTS.items():
        setattr(dist, name, _dense_only(getattr(dist, name), name, arguments))
    batch = dist.batch_isend_irecv

    @functools.wraps(batch)
    def dense_batch_isend_irecv(p2p_op_list):
        _refuse_strided("batch_isend_irecv", [op.tensor for op in p2p_op_list])
        return batch(p2p_op_list)

    dist.batch_isend_irecv = dense_batch_isend_irecv


def _dense_only(collective, name: str, arguments: tuple[tuple[int, str], ...]):
    @functools.wraps(collective)
    def checked(*args, **kwargs):
        _refuse_strided(name, [args[i] if i < len(args) else kwargs.get(key) for i, key in arguments])
        return collective(*args, **kwargs)

    return checked


def _refuse_strided(name: str, tensors: list[Any]) -> None:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
            raise ValueError(
                f"torch.distributed.{name} given a strided tensor (shape {tuple(tensor.shape)}, "
                f"stride {tensor.stride()}): NCCL refuses it (Tensors must be contiguous), gloo "
                "would read or write it as if dense"
            )


# ----------------------------------------------------------------- literal "cuda"

# torch functions that take a ``device=`` (and maybe ``pin_memory=``) keyword
_FACTORIES = (
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "empty_strided",
    "eye",
    "arange",
    "linspace",
    "logspace",
    "rand",
    "randn",
    "randint",
    "randperm",
    "tril_indices",
    "triu_indices",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
)
_TENSOR_FACTORIES = ("new_tensor", "new_zeros", "new_ones", "new_empty", "new_full")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(kwargs: dict) -> dict:
    """``kwargs`` with a CUDA ``device`` made the bridge's device and ``pin_memory`` dropped."""
    if _is_cuda(kwargs.get("device")):
        kwargs["device"] = _DEVICE
    kwargs.pop("pin_memory", None)
    return kwargs


def _cpu_factory(factory):
    @functools.wraps(factory)
    def on_cpu(*args, **kwargs):
        return factory(*args, **_on_cpu(kwargs)) if kwargs else factory(*args)

    return on_cpu


def _patch_devices() -> None:
    """Map ``device="cuda"`` (and ``.cuda()``, ``.to("cuda")``, ``pin_memory=True``) to the
    CPU by wrapping only the calls that take a device. (A TorchFunctionMode would cover
    the same calls but dispatches *every* torch op through Python: ~4 us per op, a third
    of a small model's step.)"""
    # `with torch.device(...)` recognises factories by identity from a set it caches on first
    # use: fill it with the originals first, or `torch.tensor([]).device` (transformers'
    # test for a meta-device context) would stop seeing the context
    from torch.utils import _device

    _device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _cpu_factory(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _cpu_factory(getattr(torch.Tensor, name)))
    to, type_ = torch.Tensor.to, torch.Tensor.type

    @functools.wraps(to)
    def to_cpu(self, *args, **kwargs):
        if args and _is_cuda(args[0]):  # to(device, ...): the only place a positional device goes
            args = (_DEVICE, *args[1:])
        return to(self, *args, **_on_cpu(kwargs)) if kwargs else to(self, *args)

    @functools.wraps(type_)
    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return type_(self, *args, **kwargs)
        # megatron's optimizer checks type names such as 'torch.cuda.FloatTensor'
        return "torch.cuda." + type_(self).rsplit(".", 1)[-1]

    torch.Tensor.to = to_cpu
    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: to(self, _DEVICE)
