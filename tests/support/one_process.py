"""The start every one-process check script shares (``*_checks.py``, run in a fresh Python
by the tests): the checkpoint's config, megatron's groups for one process, fixed batches."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from moe_rl.models.architectures import load_hf_config, model_dims
from moe_rl.models.forward import MicroBatch
from parallel.distributed import init_distributed
from parallel.layout import ParallelLayout


def start_one_process(hf_dir: str) -> tuple[PretrainedConfig, ParallelLayout]:
    """``hf_dir``'s config and the one-process layout, its process groups made."""
    hf_config = load_hf_config(hf_dir)
    layout = ParallelLayout()
    init_distributed(layout, model_dims(hf_config), seed=0)
    return hf_config, layout


def random_micro_batches(lengths: list[int], gen: torch.Generator, count: int = 2) -> list[MicroBatch]:
    """``count`` micro-batches of random ids below 64, right-padded rows of ``lengths``."""
    shape = (len(lengths), max(lengths))
    return [MicroBatch(torch.randint(0, 64, shape, generator=gen), lengths=torch.tensor(lengths)) for _ in range(count)]
