"""megatron-core's fully parallel load (each shard the data-parallel ranks share read by one
of them and broadcast to the others), with every exchanged shard dense."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper


class DenseShardsParallelLoad(FullyParallelLoadStrategyWrapper):
    """``FullyParallelLoadStrategyWrapper`` that reads every strided shard into a dense
    tensor of its own first. The wrapper broadcasts each shard's tensor as it is: gloo sends
    and receives a strided view (``GroupedExperts``' gate and up halves under expert TP) as
    if it were dense, silently giving wrong values, and NCCL refuses one. The loaded state
    holds the dense tensors, which the caller's ``load_state_dict`` copies from."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path):
        for shard in nested_values(sharded_state_dict):
            if isinstance(shard, ShardedTensor) and shard.data is not None and not shard.data.is_contiguous():
                shard.data = torch.empty_like(shard.data, memory_format=torch.contiguous_format)
        return super().load(sharded_state_dict, checkpoint_dir)


def parallel_load_strategy(path: Path) -> DenseShardsParallelLoad | None:
    """torch_dist's load of checkpoint ``path`` shared over the data-parallel ranks;
    ``None`` (each rank reads its own) with one data-parallel rank."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if group.size() <= 1:
        return None
    return DenseShardsParallelLoad(get_default_load_sharded_strategy(str(path / "dist")), group)
