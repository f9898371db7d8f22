"""A stand-in accelerator for CPU machines: catch a host tensor meeting a device tensor.

On a GPU, ``cuda_tensor * cpu_tensor`` fails ("Expected all tensors to be on the same
device"); on a CPU-only machine every tensor is a CPU tensor and such code runs. This
module registers a second device type, ``fakegpu`` (torch's PrivateUse1 key, set up for
a Python backend), whose tensors hold a CPU tensor inside and compute on it, and which
refuse, as CUDA does, any op that mixes them with a CPU tensor of one or more dimensions
(0-dim CPU tensors pass as scalars, as on CUDA). ``.item()``, ``.tolist()`` and
``.cpu()`` work (they synchronise on a GPU: :data:`HOST_READS` counts them, and the ops
whose output size depends on the values); ``.numpy()`` fails, as on CUDA.

Use: ``cpu_bridge.install(FAKE_DEVICE)`` before megatron starts, then run the code under
``with on_fake_device():`` -- factories given ``device=FAKE_DEVICE``, ``.to(FAKE_DEVICE)``,
``Module.to`` and collectives (unwrapped for gloo) all work. Every op pays a Python
dispatch: keep what runs under it small. Registering the device is process-wide, so
check scripts that use it run in a fresh Python.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "fakegpu"


class _BackendModule:
    """``torch.fakegpu``: what torch asks of a device module (one device, the CPU's RNG)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        pass

    @staticmethod
    def manual_seed(seed: int) -> None:
        pass

    manual_seed_all = manual_seed

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


_setup_privateuseone_for_python_backend(rename=NAME, backend_module=_BackendModule())
FAKE_DEVICE = torch.device(NAME, 0)

# factories called from C++ (inside composite ops) reach the device's kernels directly
_KERNELS = torch.library.Library("aten", "IMPL")


def _empty(*args: Any, **kwargs: Any) -> torch.Tensor:
    kwargs["device"] = torch.device("cpu")
    kwargs.pop("pin_memory", None)
    return OnDevice(torch.empty(*args, **kwargs))


def _empty_strided(size: Any, stride: Any, **kwargs: Any) -> torch.Tensor:
    kwargs["device"] = torch.device("cpu")
    kwargs.pop("pin_memory", None)
    return OnDevice(torch.empty_strided(size, stride, **kwargs))


_KERNELS.impl("empty.memory_format", _empty, "PrivateUse1")
_KERNELS.impl("empty_strided", _empty_strided, "PrivateUse1")
# reads of a device tensor's values on the host, each a device sync on a GPU, by kind: "item",
# "tolist", "to_host" (.cpu(), .to("cpu")) and "output_size" (ops whose output's size depends
# on the values: CUDA copies the size to the host first)
HOST_READS: collections.Counter = collections.Counter()
_VALUE_SIZED = {torch.ops.aten.masked_select.default, torch.ops.aten.nonzero.default, torch.ops.aten.bincount.default}


def _item(t: "OnDevice"):
    HOST_READS["item"] += 1
    return t.inner.item()


_KERNELS.impl("_local_scalar_dense", _item, "PrivateUse1")  # .item(), torch.tensor([device scalars])

# ops that legitimately take a host tensor beside a device one (copies between them)
_CROSSING = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.set_.source_Tensor}


class DeviceDisciplineError(RuntimeError):
    """A host tensor met a device tensor in one op (a crash on a GPU)."""


class OnDevice(torch.Tensor):
    """A tensor on :data:`FAKE_DEVICE`: a CPU tensor inside, the device outside."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "OnDevice":
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=FAKE_DEVICE,
            requires_grad=inner.requires_grad,
        )

    made = 0  # how many were made: a check can tell that its code ran on the device

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner
        OnDevice.made += 1

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"

    def __reduce_ex__(self, protocol: int):  # pickling (e.g. torch.save of a device tensor) sees the CPU copy
        return self.inner.__reduce_ex__(protocol)

    def tolist(self) -> Any:  # a method, so that it works where no mode is (an autograd device thread)
        HOST_READS["tolist"] += 1
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _CROSSING:
            host = [t for t in tree_flatten((args, kwargs))[0] if _is_host(t) and t.dim() > 0]
            if host:
                raise DeviceDisciplineError(
                    f"Expected all tensors to be on the same device: {func} got a CPU tensor of shape "
                    f"{list(host[0].shape)} with {NAME} tensors (on a GPU this is a crash)"
                )
        if func in _VALUE_SIZED:
            HOST_READS["output_size"] += 1
        elif func is torch.ops.aten._local_scalar_dense.default:
            HOST_READS["item"] += 1
        args, kwargs = tree_map(_unwrap, (args, kwargs))
        to_host = _is_cpu(kwargs.get("device"))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        out = func(*args, **kwargs)
        return out if to_host else tree_map(_wrap, out)


def _to_host(func, args: tuple, kwargs: dict) -> bool:
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(target, (str, torch.device)) and _is_cpu(target)
    return False


def _is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) and t.device.type == "cpu"


def _is_fake(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith(NAME)
    return isinstance(device, torch.device) and device.type == NAME


def _is_cpu(device: Any) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cpu"


def _unwrap(t: Any) -> Any:
    return t.inner if isinstance(t, OnDevice) else t


def _wrap(t: Any) -> Any:
    return OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t


def _on_device(out: Any) -> Any:
    return tree_map(_wrap, out)


_SET_DATA = torch._C.TensorBase.data.__set__


class _FakeDeviceMode(TorchFunctionMode):
    """Makes tensors *on* the fake device: factories and ``.to`` given it (or a tensor on
    it) compute on the CPU and wrap the result; ``.tolist()`` reads the inner tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_fake(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
            kwargs.pop("pin_memory", None)
            return _on_device(func(*args, **kwargs))
        if func is torch.Tensor.to and len(args) > 1:
            target = args[1]
            if _is_fake(target):
                return _wrap(func(_unwrap(args[0]), "cpu", *args[2:], **kwargs))
            if isinstance(target, OnDevice):
                return _wrap(func(_unwrap(args[0]), target.inner, *args[2:], **kwargs))
        if func == _SET_DATA and isinstance(args[0], OnDevice):  # `t.data = other`: the inner tensor follows
            if not isinstance(args[1], OnDevice):
                raise DeviceDisciplineError(f"`.data = ` a CPU tensor on a {NAME} tensor: not representable here")
            func(*args)
            args[0].inner = args[1].inner
            return None
        if func is torch.Tensor.tolist and isinstance(args[0], OnDevice):
            HOST_READS["tolist"] += 1
            return args[0].inner.tolist()
        if isinstance(args[0] if args else None, OnDevice) and _to_host(func, args, kwargs):
            HOST_READS["to_host"] += 1
        if func is torch.Tensor.numpy and isinstance(args[0], OnDevice):
            raise DeviceDisciplineError(f"can't convert {NAME} tensor to numpy: use .cpu() first (as on a GPU)")
        return func(*args, **kwargs)


_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "_all_gather_base",
    "_reduce_scatter_base",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
    "all_to_all_single",
)


@contextlib.contextmanager
def _collectives_on_inner_tensors() -> Iterator[None]:
    """gloo works on CPU storage: hand it the inner tensors (it writes them in place).
    Patched where callers look them up and where ``P2POp`` checks them (by identity)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    modules = (dist, distributed_c10d)
    saved = [
        (m, name, getattr(m, name))
        for m in modules
        for name in (*_COLLECTIVES, "batch_isend_irecv")
        if hasattr(m, name)
    ]
    originals = {name: fn for m, name, fn in saved if m is distributed_c10d}

    def unwrapping(collective):
        def call(*args, **kwargs):
            return collective(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))

        return call

    def batch_isend_irecv(ops):
        for op in ops:
            op.tensor = _unwrap(op.tensor)
            op.op = originals.get(op.op.__name__, op.op)
        return originals["batch_isend_irecv"](ops)

    patched = {name: unwrapping(fn) for name, fn in originals.items()}
    patched["batch_isend_irecv"] = batch_isend_irecv
    for m, name, _ in saved:
        setattr(m, name, patched.get(name, getattr(m, name)))
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


@contextlib.contextmanager
def on_fake_device() -> Iterator[torch.device]:
    """Run the block with :data:`FAKE_DEVICE` usable as a device (see the module docstring)."""
    with _FakeDeviceMode(), _collectives_on_inner_tensors():
        yield FAKE_DEVICE
