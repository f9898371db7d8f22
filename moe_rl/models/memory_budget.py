"""Static GPU memory per training rank for a model and a parallel layout: bf16 weights,
fp32 gradient buffers (megatron DDP with ``grad_reduce_in_fp32``), and fp32 master weights
plus Adam's two moments (12 bytes a parameter, sharded over the data-parallel ranks with
the distributed optimizer). Activations, the KV cache and allocator slack come on top.

    moe-rl budget --config configs/examples/qwen3_30b_a3b_2x8.yaml --world 16 \\
        [--hf-config configs/examples/qwen3_30b_a3b.config.json]     (moe_rl/commands/budget.py)

It also prints what a checkpoint save adds per rank, for both settings of
``train.checkpoint_reshardable`` (:func:`save_budget`, read off megatron-core 0.16.1's
``DistributedOptimizer`` and dist_checkpointing's async writer).

Parameters are counted exactly on transformers' model built on the meta device (no memory):
names with ``.experts.`` are routed experts (split over EP x ETP), the rest dense (split over
TP; the embedding on the first stage, the output layer on the last, each decoder layer on the
stage megatron-core puts it, uneven stages included: ``parallel.ParallelLayout.stage_layers``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings

GB = 1e9
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12  # bf16; fp32 main_grad; fp32 master + Adam m, v


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding
    output: int  # output layer and final norm
    layers_dense: int  # attention, norms, routers, shared experts, dense MLPs of all layers
    layers_expert: int  # routed experts of all layers
    # tied embeddings: the output layer's copy of the embedding, which megatron keeps only on
    # a last pipeline stage that is not the first (pp > 1); counted in no total
    tied_output: int = 0

    @property
    def total(self) -> int:
        """The model's parameters (a tied embedding once)."""
        return self.embedding + self.output + self.layers_dense + self.layers_expert


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False  # DDP buckets of max(40M, 1M x dp) parameters; off: one per buffer
    first_stage_layers: int | None = None  # as parallel.first_stage_layers
    last_stage_layers: int | None = None

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers per pipeline stage, as the trainer splits them."""
        split = ParallelLayout(
            pp=self.pp, first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers
        )
        return split.stage_layers(num_layers)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.etp * self.pp)


@functools.lru_cache(maxsize=4)
def _parameter_sizes(config_json: str) -> tuple[bool, tuple[tuple[str, int], ...]]:
    """(tied embeddings, (name, size) of each parameter) of transformers' model on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import moe_rl.models.architectures  # noqa: F401  (model types transformers lacks: kimi_k2)

    config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return bool(getattr(config, "tie_word_embeddings", False)), tuple(
        (n, p.numel()) for n, p in model.named_parameters()
    )


def count_params(hf_config: dict) -> ParamCounts:
    """Exact counts from transformers' model for ``hf_config`` (a config.json's mapping)."""
    tied, sizes = _parameter_sizes(json.dumps(hf_config, sort_keys=True))
    counts = {"embedding": 0, "output": 0, "layers_dense": 0, "layers_expert": 0}
    for name, size in sizes:
        if ".layers." not in name:
            counts["embedding" if "embed_tokens" in name else "output"] += size
        else:
            counts["layers_expert" if ".experts." in name else "layers_dense"] += size
    return ParamCounts(**counts, tied_output=counts["embedding"] if tied else 0)


def layer_params(hf_config: dict) -> list[tuple[int, int]]:
    """(dense, routed-expert) parameters of each decoder layer (DeepSeek-V3's first layers
    are dense: no experts, a wider MLP)."""
    _, sizes = _parameter_sizes(json.dumps(hf_config, sort_keys=True))
    layers = [[0, 0] for _ in range(hf_config["num_hidden_layers"])]
    for name, size in sizes:
        if ".layers." in name:
            layers[int(name.split(".layers.")[1].split(".")[0])][".experts." in name] += size
    return [(dense, expert) for dense, expert in layers]


def stage_params(
    counts: ParamCounts, layout: Layout, stage: int, layers: list[tuple[int, int]] | None = None
) -> tuple[float, float]:
    """(dense, routed-expert) parameters one rank of pipeline stage ``stage`` holds (dense
    parts split over TP, experts over EP x ETP): the stage's own decoder layers of ``layers``
    (:func:`layer_params`), or without them an equal share of every layer's parameters."""
    if layers is None:
        dense, expert = counts.layers_dense / layout.pp, counts.layers_expert / layout.pp
    else:
        split = layout.stage_layers(len(layers))
        mine = layers[sum(split[:stage]) : sum(split[: stage + 1])]
        dense, expert = sum(d for d, _ in mine), sum(e for _, e in mine)
    if stage == 0:
        dense += counts.embedding
    if stage == layout.pp - 1:
        dense += counts.output + (counts.tied_output if layout.pp > 1 else 0)
    return dense / layout.tp, expert / (layout.ep * layout.etp)


def stage_budget(
    counts: ParamCounts, layout: Layout, stage: int, layers: list[tuple[int, int]] | None = None
) -> dict[str, float]:
    """GB per rank of pipeline stage ``stage`` (:func:`stage_params`)."""
    dense, expert = stage_params(counts, layout, stage, layers)
    held = dense + expert
    sharded = dense / layout.dp + expert / layout.expert_dp if layout.distributed_optimizer else held
    out = {
        "params_B": held / 1e9,
        "weights_GB": held * WEIGHT_BYTES / GB,
        "grads_GB": held * GRAD_BYTES / GB,
        "optimizer_GB": sharded * OPTIMIZER_BYTES / GB,
    }
    out["total_GB"] = out["weights_GB"] + out["grads_GB"] + out["optimizer_GB"]
    return out


def save_budget(
    counts: ParamCounts,
    layout: Layout,
    stage: int,
    layers: list[tuple[int, int]] | None = None,
    *,
    reshardable: bool = True,
) -> dict[str, float]:
    """GB a checkpoint save adds on one rank of ``stage`` (megatron-core 0.16.1):

    - ``staged_GB`` (host, from the save until the rank's writer is done): what the rank
      writes, copied off the GPU for the forked writer: its share of the bf16 weights and
      of the fp32 master weights and Adam moments (12 bytes a parameter). The fully parallel
      save splits every tensor replicated over data-parallel ranks among them, so the share is
      dense / dp + experts / expert dp, the same for both settings.
    - ``reshardable`` (``fully_reshardable``): ``get_parameter_state_dp_zero`` all-gathers the
      optimizer state over the data-parallel group into host tensors of every parameter the
      rank holds, on every rank (``gathered_GB``: 12 bytes x held parameters, alive while the
      save stages), one key (param, exp_avg, exp_avg_sq) of one gradient bucket at a time:
      ``gpu_transient_GB`` (the all-gather's receive buffers, 4 bytes x the bucket, plus the
      sent shard) and 8 bytes x the bucket more host (their host copies and the concatenation).
      One bucket per buffer (dense, experts) unless ``overlap_grad_reduce``.
    - not ``reshardable`` (``dp_reshardable``): each rank's own shard as it is, no gather:
      nothing but the staging.
    The plain (not distributed) optimizer gathers nothing either way."""
    dense, expert = stage_params(counts, layout, stage, layers)
    share = dense / layout.dp + expert / layout.expert_dp
    staged = share * (WEIGHT_BYTES + OPTIMIZER_BYTES) / GB
    out = {"staged_GB": staged, "gathered_GB": 0.0, "gpu_transient_GB": 0.0, "host_peak_GB": staged}
    if reshardable and layout.distributed_optimizer:
        gathered = (dense + expert) * OPTIMIZER_BYTES / GB
        transient, host_transient = 0.0, 0.0
        for held, dp in ((dense, layout.dp), (expert, layout.expert_dp)):
            bucket = min(held, max(40e6, 1e6 * dp)) if layout.overlap_grad_reduce else held
            transient = max(transient, bucket * 4 * (1 + 1 / dp) / GB)
            host_transient = max(host_transient, bucket * 8 / GB)
        peak = max(gathered + staged, gathered + host_transient)
        out.update(gathered_GB=gathered, gpu_transient_GB=transient, host_peak_GB=peak)
    return out


def budget(counts: ParamCounts, layout: Layout, layers: list[tuple[int, int]] | None = None) -> dict[str, float]:
    """The largest stage's budget (the one that must fit)."""
    return max((stage_budget(counts, layout, s, layers) for s in range(layout.pp)), key=lambda b: b["total_GB"])


def layout_of(parallel: ParallelLayout, optim: OptimSettings, world: int) -> Layout:
    """A config's ``parallel`` and ``optim`` on ``world`` ranks (validated by the caller), the
    distributed optimizer as the trainer decides it (``None``: on where the dense or the
    expert data-parallel group has more than one rank)."""
    layout = Layout(
        world=world,
        tp=parallel.tp,
        pp=parallel.pp,
        ep=parallel.ep,
        etp=parallel.expert_tp,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        first_stage_layers=parallel.first_stage_layers,
        last_stage_layers=parallel.last_stage_layers,
    )
    sharded = optim.use_distributed_optimizer
    return dataclasses.replace(
        layout, distributed_optimizer=sharded if sharded is not None else layout.dp > 1 or layout.expert_dp > 1
    )
