"""SGLang's ``routed_experts`` encoding, the integer type routing is kept in, and routing
files saved by training runs.

SGLang (``--enable-return-routed-experts``, request ``"return_routed_experts": true``)
returns ``meta_info["routed_experts"]``: base64 of raw little-endian int32 with shape
``[prompt_len + output_len - 1, num_layers, top_k]`` (the last token is never fed back,
so it has no routing). moe-rl keeps expert indices in :func:`expert_index_dtype` (1 byte
per token, layer and choice up to 256 experts) from decoding to the point of use, where
megatron-core gets int64 one layer at a time. A routing file is a safetensors file with
``indices`` ``[T, L, k]`` and optionally ``probs`` ``[T, L, E]`` and ``mask`` ``[T]``, and
the model's expert count in its metadata (``num_experts``).
"""

from __future__ import annotations

import os

import numpy as np
import pybase64
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor


_NUMPY_TYPES = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}


def expert_index_dtype(num_experts: int) -> torch.dtype:
    """The integer type expert indices are kept in: the smallest that holds ``0 ..
    num_experts - 1`` (uint8 up to 256 experts, int16 up to 32,768, else int32)."""
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    return next(d for d in _NUMPY_TYPES if num_experts - 1 <= torch.iinfo(d).max)


def decode_routed_experts(data: str, num_layers: int, top_k: int, num_experts: int | None = None) -> Tensor:
    """``[n, num_layers, top_k]`` from SGLang's base64 string, in
    :func:`expert_index_dtype` of ``num_experts`` (int32, SGLang's own, when not given),
    every id checked to be in ``[0, num_experts)`` (``>= 0`` when not given)."""
    # pybase64 (SIMD): 1.0 ms for an 8k-token, 48-layer, top-8 reply against base64's 46.5 ms
    # (2026-12-06), GIL-held time on the first rank's event loop once per sample
    raw = pybase64.b64decode(data, validate=True)
    per_token = num_layers * top_k * 4
    if len(raw) % per_token:
        raise ValueError(
            f"routed_experts has {len(raw)} bytes, not a multiple of num_layers*top_k*4 = {per_token}: "
            "do the server's model and num_layers/top_k agree?"
        )
    wide = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
    if wide.size and (int(wide.min()) < 0 or (num_experts is not None and int(wide.max()) >= num_experts)):
        raise ValueError(
            f"routed_experts has expert ids outside [0, {num_experts if num_experts is not None else 'inf'})"
        )
    dtype = torch.int32 if num_experts is None else expert_index_dtype(num_experts)
    return torch.from_numpy(wide.astype(_NUMPY_TYPES[dtype]))


def repeats_an_expert(indices: Tensor) -> bool:
    """Whether some token's top-k (the last dimension of a CPU tensor) names an expert
    twice: one comparison of two choice columns per pair, no sort (~1 ms on 8k x 48 x 8)."""
    columns = np.ascontiguousarray(indices.numpy().reshape(-1, indices.shape[-1]).T)
    k = columns.shape[0]
    return any(bool((columns[i] == columns[j]).any()) for i in range(k) for j in range(i + 1, k))


def encode_routed_experts(indices: Tensor) -> str:
    """Inverse of :func:`decode_routed_experts` (used by the local engine)."""
    if indices.dim() != 3:
        raise ValueError(f"routed experts must be [n, num_layers, top_k], got {tuple(indices.shape)}")
    return pybase64.b64encode(indices.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def save_routing(
    path: str | os.PathLike,
    indices: Tensor,
    probs: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    num_experts: int | None = None,
) -> None:
    """``indices`` ``[T, L, k]`` (and ``probs`` ``[T, L, E]``, ``mask`` ``[T]``) as a routing
    file; ``num_experts``: the model's (``probs``' last size when not given), which the
    expert load needs (an expert never chosen leaves no index)."""
    tensors = {"indices": indices.to(torch.int32).contiguous()}
    if probs is not None:
        tensors["probs"] = probs.float().contiguous()
        num_experts = probs.shape[-1] if num_experts is None else num_experts
    if mask is not None:
        tensors["mask"] = mask.to(torch.uint8).contiguous()
    save_file(tensors, str(path), metadata={"num_experts": str(num_experts)} if num_experts is not None else None)


def routing_num_experts(path: str | os.PathLike) -> int | None:
    """The expert count a routing file records (``None``: it records none)."""
    with safe_open(str(path), framework="pt") as f:
        value = (f.metadata() or {}).get("num_experts")
    return int(value) if value is not None else None


def load_routing(path: str | os.PathLike) -> dict[str, Tensor]:
    tensors = load_file(str(path))
    if "indices" not in tensors or tensors["indices"].dim() != 3:
        raise ValueError(f"{path} is not a routing file (needs 'indices' [T, L, k])")
    return tensors
