"""The parallel layout: tensor (TP), pipeline (PP), expert (EP), expert-tensor (ETP)
and data (DP) sizes, validated against the world size and the model before any
process group exists."""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the bad value."""


@dataclass(frozen=True)
class ModelDims:
    """The model sizes a layout must divide."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: int | None
    vocab_size: int
    ffn_hidden_size: int | None = None  # expert FFN size (split by ETP)
    shared_ffn_hidden_size: int | None = None  # shared expert FFN size (split by TP)


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel sizes; ``etp=None`` means ETP = TP (megatron-core's default);
    ``sequence_parallel=None`` turns it on exactly when TP > 1 (MoE requires it then)."""

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    ep: int = 1  # expert parallel
    etp: int | None = None  # expert tensor parallel (null: tp)
    sequence_parallel: bool | None = None  # null: on exactly when tp > 1 (MoE needs it then)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def use_sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def seq_len_multiple(self) -> int:
        """Sequence lengths must be a multiple of this: sequence parallelism splits every
        micro-batch's sequence evenly over the tensor-parallel ranks."""
        return self.tp if self.use_sequence_parallel else 1

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def expert_dp(self, world_size: int) -> int:
        return world_size // (self.pp * self.ep * self.expert_tp)

    def validate(self, world_size: int, model: ModelDims | None = None) -> None:
        """Raise :class:`LayoutError` naming the first value that does not fit."""
        for name, value in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("etp", self.expert_tp)):
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} must be a positive integer")
        if world_size < 1:
            raise LayoutError(f"world size {world_size} must be >= 1")
        if world_size % (self.tp * self.pp):
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp = {self.tp}*{self.pp} = {self.tp * self.pp}"
            )
        per_stage = world_size // self.pp
        if per_stage % (self.ep * self.expert_tp):
            raise LayoutError(
                f"world size / pp = {per_stage} is not divisible by ep*etp = {self.ep}*{self.expert_tp} "
                f"= {self.ep * self.expert_tp}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("parallel.sequence_parallel=True needs tp > 1")
        if model is None:
            return
        if model.num_experts and self.tp > 1 and not self.use_sequence_parallel:
            raise LayoutError("parallel.sequence_parallel=False with tp > 1: megatron-core MoE needs it on")
        checks = [
            ("model.num_layers", model.num_layers, "pp", self.pp),
            ("model.num_attention_heads", model.num_attention_heads, "tp", self.tp),
            ("model.num_query_groups (key/value heads)", model.num_query_groups, "tp", self.tp),
        ]  # (the vocabulary is padded to a multiple of tp: any size works)
        if model.num_experts:
            checks.append(("model.num_experts", model.num_experts, "ep", self.ep))
            if model.ffn_hidden_size:
                checks.append(("model.moe_ffn_hidden_size", model.ffn_hidden_size, "etp", self.expert_tp))
            if model.shared_ffn_hidden_size:
                checks.append(("model.shared_expert_ffn_hidden_size", model.shared_ffn_hidden_size, "tp", self.tp))
        elif self.ep > 1:
            raise LayoutError(f"parallel.ep={self.ep} but the model has no experts")
        for what, size, name, value in checks:
            if size % value:
                raise LayoutError(f"{what}={size} is not divisible by parallel.{name}={value}")
