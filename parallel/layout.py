"""The parallel layout: tensor (TP), pipeline (PP), expert (EP), expert-tensor (ETP)
and data (DP) sizes, validated against the world size and the model before any
process group exists."""

from __future__ import annotations

from dataclasses import dataclass


# the world size is the number of processes: what to change when the layout does not fit it
WORLD_SIZE_HINT = " (the world size is the number of processes: moe-rl train --nproc N, or the launcher's)"


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
    # decoder layers on the first pipeline stage (megatron-core's num_layers_in_first_pipeline_stage);
    # null: as many as a middle stage. Both null: an even split, or where model layers do not divide
    # by pp, ceil(layers / pp) on each middle stage and the rest on the ends (61 on pp=8: 7, 8 x 6, 6)
    first_stage_layers: int | None = None
    # decoder layers on the last pipeline stage (null: as for first_stage_layers)
    last_stage_layers: int | None = None

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

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers on each pipeline stage, first to last (megatron-core splits them so:
        ``first_stage_layers`` and ``last_stage_layers`` where set, the rest evenly).

        With neither set, an even split where ``num_layers`` divides by ``pp``; otherwise the
        middle stages take ``ceil(num_layers / pp)`` each (megatron needs them equal; fewer
        only where the ends would be left empty) and the first and last stages the rest, the
        last the smaller half. So no stage holds more than ``ceil(num_layers / pp)`` layers (where
        equal middle stages allow it; 29 layers on pp=16 do not: 8, 1 x 14, 7),
        and the spare capacity goes to the two stages that also hold the embedding and the
        output layer with its log-prob head (megatron's ``account_for_loss_in_pipeline_split``
        counts that head as a layer). DeepSeek-V3's 61 layers on pp=8: 7, 8 x 6, 6; a dense
        first layer and 2 MoE layers on pp=2: 2, 1."""
        pp, first, last = self.pp, self.first_stage_layers, self.last_stage_layers
        if num_layers < pp:
            raise LayoutError(f"model.num_layers={num_layers} is fewer than parallel.pp={pp} pipeline stages")
        if first is None and last is None:
            return _balanced_stage_layers(num_layers, pp)
        if pp == 1:
            raise LayoutError("parallel.first_stage_layers / last_stage_layers need parallel.pp > 1")
        rest = num_layers - (first or 0) - (last or 0)
        others = pp - (first is not None) - (last is not None)  # stages that share the rest evenly
        given = " and ".join(
            f"parallel.{k}_stage_layers={v}" for k, v in (("first", first), ("last", last)) if v is not None
        )
        if others == 0 and rest:
            raise LayoutError(f"{given} add up to {num_layers - rest} on pp=2, but model.num_layers={num_layers}")
        if others and (rest < others or rest % others):
            raise LayoutError(
                f"{given} leave {rest} of model.num_layers={num_layers} layers for the other {others} "
                "pipeline stage(s), which need the same number each, at least one"
            )
        middle = rest // others if others else 0
        return (middle if first is None else first, *[middle] * (pp - 2), middle if last is None else last)

    def megatron_stage_layers(self, num_layers: int) -> dict[str, int | None]:
        """megatron-core's ``num_layers_in_first/last_pipeline_stage`` for :meth:`stage_layers`
        (both ``None``: its even split)."""
        stages = self.stage_layers(num_layers)
        uneven = len(set(stages)) > 1
        return dict(
            num_layers_in_first_pipeline_stage=stages[0] if uneven else None,
            num_layers_in_last_pipeline_stage=stages[-1] if uneven else None,
        )

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
                f"{WORLD_SIZE_HINT}"
            )
        per_stage = world_size // self.pp
        if per_stage % (self.ep * self.expert_tp):
            raise LayoutError(
                f"world size / pp = {per_stage} is not divisible by ep*etp = {self.ep}*{self.expert_tp} "
                f"= {self.ep * self.expert_tp}{WORLD_SIZE_HINT}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("parallel.sequence_parallel=True needs tp > 1")
        for name, layers in (
            ("first_stage_layers", self.first_stage_layers),
            ("last_stage_layers", self.last_stage_layers),
        ):
            if layers is not None and (not isinstance(layers, int) or layers < 1):
                raise LayoutError(f"parallel.{name}={layers!r} must be a positive integer (or null)")
        if model is None:
            return
        if model.num_experts and self.tp > 1 and not self.use_sequence_parallel:
            raise LayoutError("parallel.sequence_parallel=False with tp > 1: megatron-core MoE needs it on")
        self.stage_layers(model.num_layers)
        checks = [
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


def _balanced_stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """:meth:`ParallelLayout.stage_layers` with neither end set (``num_layers >= pp``)."""
    if pp == 1 or num_layers % pp == 0:
        return (num_layers // pp,) * pp
    middle = -(-num_layers // pp)
    while num_layers - (pp - 2) * middle < 2:  # each end keeps at least one layer
        middle -= 1
    ends = num_layers - (pp - 2) * middle
    return (ends - ends // 2, *[middle] * (pp - 2), ends // 2)
