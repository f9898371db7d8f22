"""SGLang's ``routed_experts`` encoding, and routing files saved by training runs.

SGLang (``--enable-return-routed-experts``, request ``"return_routed_experts": true``)
returns ``meta_info["routed_experts"]``: base64 of raw little-endian int32 with shape
``[prompt_len + output_len - 1, num_layers, top_k]`` (the last token is never fed back,
so it has no routing). A routing file is a safetensors file with ``indices`` ``[T, L, k]``
and optionally ``probs`` ``[T, L, E]`` and ``mask`` ``[T]``.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor


def decode_routed_experts(data: str, num_layers: int, top_k: int) -> Tensor:
    """``[n, num_layers, top_k]`` int32 from SGLang's base64 string."""
    raw = base64.b64decode(data)
    per_token = num_layers * top_k * 4
    if len(raw) % per_token:
        raise ValueError(
            f"routed_experts has {len(raw)} bytes, not a multiple of num_layers*top_k*4 = {per_token}: "
            "do the server's model and num_layers/top_k agree?"
        )
    array = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
    return torch.from_numpy(array.astype(np.int32))


def encode_routed_experts(indices: Tensor) -> str:
    """Inverse of :func:`decode_routed_experts` (used by the local engine)."""
    if indices.dim() != 3:
        raise ValueError(f"routed experts must be [n, num_layers, top_k], got {tuple(indices.shape)}")
    return base64.b64encode(indices.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def save_routing(path: str | os.PathLike, indices: Tensor, probs: Tensor | None = None, mask: Tensor | None = None) -> None:
    tensors = {"indices": indices.to(torch.int32).contiguous()}
    if probs is not None:
        tensors["probs"] = probs.float().contiguous()
    if mask is not None:
        tensors["mask"] = mask.to(torch.uint8).contiguous()
    save_file(tensors, str(path))


def load_routing(path: str | os.PathLike) -> dict[str, Tensor]:
    tensors = load_file(str(path))
    if "indices" not in tensors or tensors["indices"].dim() != 3:
        raise ValueError(f"{path} is not a routing file (needs 'indices' [T, L, k])")
    return tensors
