"""This rank's routed experts as two stacked weights: the experts module moe-rl's layer
spec gives megatron-core's ``MoELayer`` (in place of ``SequentialMLP``, one ``MLP``
module per expert).

``linear_fc1.weight`` is ``[local experts, 2 * ffn / ETP, hidden]`` (each expert's gate
rows, then its up rows, as ``SequentialMLP``'s ``linear_fc1``), ``linear_fc2.weight``
``[local experts, hidden, ffn / ETP]``. The tokens arrive grouped by expert (the token
dispatcher's output), so each projection is one grouped matmul (``torch.nn.functional.
grouped_mm``) where it runs, otherwise one matmul per expert over the stacked weight.
No communication happens here: the dispatcher moves tokens between expert-parallel and
expert-tensor-parallel ranks and reduces the partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


def init_device(config: TransformerConfig) -> torch.device | str | int:
    """Where a layer creates its parameters, as megatron's own layers do: the CPU under
    ``use_cpu_initialization``, else the rank's device."""
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def grouped_mm_runs(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> bool:
    """Whether torch's grouped matmul has a kernel for weights of ``dtype`` on a
    ``device_type`` device (CUDA: of compute ``capability``): any dtype on the CPU; bf16 on
    CUDA GPUs of capability 9.0 (Hopper) and up, torch's CUTLASS kernels. Elsewhere torch
    would fall back to a matmul per group after copying the offsets to the host: no better
    than :class:`StackedLinear`'s own loop."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device_type == "cpu":
        return True
    return device_type == "cuda" and dtype == torch.bfloat16 and capability is not None and capability >= (9, 0)


class StackedLinear(torch.nn.Module):
    """``weight[e]`` applied to the rows of expert ``e`` (rows grouped by expert)."""

    def __init__(
        self, experts: int, out_features: int, in_features: int, config: TransformerConfig, partition_dim: int
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(experts, out_features, in_features, dtype=config.params_dtype, device=init_device(config))
        )
        # always "parallel", as megatron marks its expert linears: each rank's slice is its own
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=partition_dim, stride=1)
        itemsize, device = self.weight.element_size(), self.weight.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        self.grouped = (
            grouped_mm_runs(device.type, self.weight.dtype, capability)
            and (in_features * itemsize) % 16 == 0
            and (out_features * itemsize) % 16 == 0
        )

    def forward(self, rows: Tensor, offsets: Tensor, sizes: list[int] | None) -> Tensor:
        """``offsets``: where each expert's rows end (int32, on the rows' device);
        ``sizes``: its row counts, needed only where the grouped matmul does not run."""
        if self.grouped and rows.shape[0] > 0:
            return F.grouped_mm(rows.to(self.weight.dtype), self.weight.mT, offs=offsets)
        return torch.cat([F.linear(group, self.weight[e]) for e, group in enumerate(rows.split(sizes))])


class GroupedExperts(MegatronModule):
    """Drop-in for megatron-core's ``SequentialMLP`` (same constructor and ``forward``
    contract; gated SiLU, no biases, as every supported family)."""

    counts_on_device = True  # takes tokens_per_expert on the device (no host copy needed)

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None, pg_collection=None) -> None:
        super().__init__(config=config)
        plain_glu = (
            config.gated_linear_unit and config.activation_func_clamp_value is None and not config.glu_linear_offset
        )
        if config.add_bias_linear or not plain_glu or config.fp8 or config.fp4:
            raise ValueError("GroupedExperts runs gated experts without biases, clamps or fp8/fp4 only")
        etp = pg_collection.expt_tp.size()
        ffn = config.moe_ffn_hidden_size // etp
        self.num_local_experts = num_local_experts
        self.pg_collection = pg_collection
        self.linear_fc1 = StackedLinear(num_local_experts, 2 * ffn, config.hidden_size, config, partition_dim=1)
        self.linear_fc2 = StackedLinear(num_local_experts, config.hidden_size, ffn, config, partition_dim=2)
        if config.perform_initialization:
            with torch.no_grad():
                for e in range(num_local_experts):
                    config.init_method(self.linear_fc1.weight[e])
                    config.output_layer_init_method(self.linear_fc2.weight[e])

    def forward(
        self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor
    ) -> tuple[Tensor, None]:
        rows, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # (top-1 only, as SequentialMLP)
            rows, probs = (probs.unsqueeze(-1) * rows).to(rows.dtype), torch.ones_like(probs)
        offsets = tokens_per_expert.to(device=rows.device).cumsum(0).to(torch.int32)
        # the per-expert path needs the counts on the host: one device sync, for both projections
        grouped = self.linear_fc1.grouped and self.linear_fc2.grouped and rows.shape[0] > 0
        sizes = None if grouped else tokens_per_expert.tolist()
        gate, up = self.linear_fc1(rows, offsets, sizes).chunk(2, dim=-1)
        hidden = self.config.activation_func(gate) * up
        hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
        return self.linear_fc2(hidden, offsets, sizes), None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> ShardedStateDict:
        """The stacked weights as global ``[experts, out, in]`` tensors under the keys
        megatron's ``SequentialMLP`` uses (``{prefix}experts.linear_fc1.weight``, ...):
        this rank's experts at their expert-parallel offset, its expert-TP slice of the
        FFN dimension, and ``linear_fc1``'s gate and up rows as the two halves of the global
        rows (as megatron's GLU factory stores them). A checkpoint therefore loads under
        any EP / expert-TP (``megatron.core.dist_checkpointing``)."""
        ep, etp, expt_dp = self.pg_collection.ep, self.pg_collection.expt_tp, self.pg_collection.expt_dp
        axis = len(sharded_offsets)  # this tensor's expert axis in the global shape (after e.g. a layer axis)
        experts = (axis, ep.rank(), ep.size())
        replica_id = (0, 0, expt_dp.rank())

        def sharded(key: str, tensor: Tensor, *offsets: tuple[int, int, int]) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(
                key, tensor, *sharded_offsets, experts, *offsets, replica_id=replica_id, prepend_axis_num=axis
            )

        def gate_and_up(key: str, tensor: Tensor, replica, flattened_range) -> list[ShardedTensor]:
            gate, up = tensor.chunk(2, dim=1)
            return [
                sharded(key, gate, (axis + 1, etp.rank(), 2 * etp.size())),
                sharded(key, up, (axis + 1, etp.size() + etp.rank(), 2 * etp.size())),
            ]

        fc1_key, fc2_key = f"{prefix}experts.linear_fc1.weight", f"{prefix}experts.linear_fc2.weight"
        fc1 = (
            # one expert-TP rank holds all gate rows, then all up rows: the global order already
            # (stored whole: the halves would be strided views, copied before every background save)
            sharded(fc1_key, self.linear_fc1.weight)
            if etp.size() == 1
            else ShardedTensorFactory(
                fc1_key, self.linear_fc1.weight, gate_and_up, lambda halves: torch.cat(halves, dim=1), replica_id
            )
        )
        return {
            f"{prefix}linear_fc1.weight": fc1,
            f"{prefix}linear_fc2.weight": sharded(fc2_key, self.linear_fc2.weight, (axis + 2, etp.rank(), etp.size())),
        }
