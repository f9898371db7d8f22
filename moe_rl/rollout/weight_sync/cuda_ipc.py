"""SGLang's ``MultiprocessingSerializer`` form of tensors shared by reference: CUDA tensors as
IPC handles whose device is named by its UUID, CPU tensors as shared memory."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import Tensor


_DEVICE_ARG = 6  # where torch's CUDA tensor reduction puts the device index (what SGLang's patch replaces)


def _reduce_tensor_by_uuid(tensor: Tensor):
    """torch's multiprocessing reduction of ``tensor``, a CUDA tensor's device named by its
    UUID (SGLang's patched reductions do the same: a server rank that sees other device
    numbers still maps the right GPU; its ``rebuild_cuda_tensor`` takes a UUID or an index)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = (
            *args[:_DEVICE_ARG],
            str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
            *args[_DEVICE_ARG + 1 :],
        )
    return rebuild, args


def serialize_for_sglang(obj: object) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` with its patched
    torch reductions: base64 of torch's multiprocessing pickle (CUDA tensors as IPC handles
    whose device is named by UUID, CPU tensors as shared memory), without SGLang installed
    and without changing torch's reductions for the rest of this process."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    from torch import multiprocessing as _registers_tensor_reductions  # noqa: F401

    class UuidPickler(ForkingPickler):
        _extra_reducers = {
            **ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
            torch.Tensor: _reduce_tensor_by_uuid,
            torch.nn.Parameter: _reduce_tensor_by_uuid,
        }

    buffer = io.BytesIO()
    UuidPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def deserialize_sglang_payload(text: str) -> Any:
    """The inverse of :func:`serialize_for_sglang` (what a server rank does): a CUDA
    tensor's device UUID mapped to this process's index for that GPU."""
    import base64
    import io

    from torch import multiprocessing as _registers_tensor_reductions  # noqa: F401

    class UuidUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return _rebuild_cuda_tensor_by_uuid
            return super().find_class(module, name)

    return UuidUnpickler(io.BytesIO(base64.b64decode(text))).load()


def _rebuild_cuda_tensor_by_uuid(*args):
    from torch.multiprocessing import reductions

    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        matches = [
            i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not matches:
            raise RuntimeError(f"no GPU with UUID {device} is visible to this process")
        args = (*args[:_DEVICE_ARG], matches[0], *args[_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)
