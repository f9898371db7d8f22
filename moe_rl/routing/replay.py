"""Routing replay on megatron-core's own ``RouterReplay`` (docs/routing.md).

- ``r2``: record every MoE layer's top-k in the old-policy log-prob pass; replay it in
  the training forward and in activation recompute.
- ``r3``: replay the routing the rollout engine returned (SGLang's ``routed_experts``)
  in both the old-log-prob and the training passes.

Replay forces the *expert choice*; the gate weights are recomputed from the live router
logits at the replayed indices, so the router keeps its gradient. Indices are handled
per micro-batch and per rank in megatron's token order: ``[s, b]`` flattened, this
rank's sequence-parallel slice, this pipeline stage's MoE layers. They are kept in
:func:`moe_rl.routing.encoding.expert_index_dtype` (1 byte per token, layer and choice up
to 256 experts) and become the int64 megatron-core gathers with one layer at a time, as a
micro-batch's forward starts.
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from moe_rl.models.forward import megatron_module
from moe_rl.routing.encoding import expert_index_dtype
from moe_rl.routing.modes import REPLAY_MODES


class ReplayError(RuntimeError):
    """Recorded routing that does not match the pass replaying it."""


def replay_config_overrides(mode: str) -> dict:
    """``TransformerConfig`` settings a replay mode needs."""
    if mode not in REPLAY_MODES:
        raise ValueError(f"unknown routing replay mode {mode!r}; valid: {', '.join(REPLAY_MODES)}")
    return {"moe_enable_routing_replay": mode != "none"}


def moe_layers(model: torch.nn.Module) -> list[tuple[int, TopKRouter]]:
    """``(global 0-based layer number, router)`` of this rank's MoE layers, in order."""
    out = []
    for layer in megatron_module(model).decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out.append((layer.layer_number - 1, router))
    return out


class _Phase(Enum):
    IDLE = "idle"
    RECORD = "record"
    REPLAY = "replay"


class RoutingReplay:
    """This model's ``RouterReplay`` instances, driven per micro-batch.

    Use as the ``hooks`` of :func:`moe_rl.models.forward.run_microbatches`:
    :meth:`start_record` before the old-log-prob pass and :meth:`recorded` after it;
    :meth:`start_replay` with per-micro-batch indices before a pass that replays them,
    and :meth:`finish` after its backward (checks every entry was consumed once).
    """

    def __init__(self, model: torch.nn.Module, recompute: bool = False) -> None:
        layers = moe_layers(model)
        self.layer_numbers = [n for n, _ in layers]
        self.instances: list[RouterReplay] = []
        for _, router in layers:
            if router.router_replay is None:
                raise ValueError("the model was built without moe_enable_routing_replay=True")
            if router.config.moe_router_fusion:
                raise ValueError(
                    "routing replay with moe_router_fusion=True: megatron-core's fused router (Transformer Engine's "
                    "fused_topk_with_score_function) never asks RouterReplay, so nothing would be replayed; build the "
                    "model with moe_router_fusion=False"
                )
            self.instances.append(router.router_replay)
        self.top_k = layers[0][1].topk if layers else 0
        self.index_dtype = expert_index_dtype(layers[0][1].config.num_moe_experts) if layers else torch.uint8
        self.recompute = recompute
        self._phase = _Phase.IDLE
        self._record: dict[int, list[Tensor]] = {}
        self._replay: Sequence[Sequence[Tensor]] = ()
        self._replayed: set[int] = set()
        self._keep_backward = False

    # ---------------------------------------------------------------- recording

    def start_record(self) -> None:
        self._check_idle()
        self._phase, self._record = _Phase.RECORD, {}
        self._set_action(RouterReplayAction.RECORD)

    def recorded(self) -> list[list[Tensor]]:
        """Per micro-batch, per MoE layer: the recorded top-k ``[tokens, k]`` (``index_dtype``)."""
        if self._phase is not _Phase.RECORD:
            raise ReplayError("recorded() without start_record()")
        self._reset()
        return [self._record[i] for i in sorted(self._record)]

    # ---------------------------------------------------------------- replaying

    def start_replay(self, per_microbatch: Sequence[Sequence[Tensor]], *, forward_only: bool = False) -> None:
        """Replay ``per_microbatch[i][layer]`` in micro-batch i; ``forward_only`` passes
        have no backward, so keep no entries for activation recompute."""
        self._check_idle()
        self._keep_backward = self.recompute and not forward_only
        for mb, layers in enumerate(per_microbatch):
            if len(layers) != len(self.instances):
                raise ReplayError(
                    f"micro-batch {mb}: routing for {len(layers)} MoE layers, this rank has {len(self.instances)}"
                )
        self._phase, self._replay, self._replayed = _Phase.REPLAY, per_microbatch, set()

    def finish(self) -> None:
        """After the replayed pass (and its backward): every micro-batch replayed once,
        every recompute entry consumed; then clears all state."""
        if self._phase is _Phase.REPLAY:
            missing = set(range(len(self._replay))) - self._replayed
            leftover = sum(len(r.replay_backward_list) for r in self.instances) if self._keep_backward else 0
            self._reset()
            if missing:
                raise ReplayError(f"routing recorded for micro-batches {sorted(missing)} was never replayed")
            if leftover:
                raise ReplayError(f"{leftover} recompute replay entries were not consumed by the backward pass")
        else:
            self._reset()

    def abort(self) -> None:
        """Drop all state after a pass that failed (no checks)."""
        self._reset()

    # ---------------------------------------------------------------- hooks

    def before_forward(self, index: int, num_tokens: int) -> None:
        if self._phase is _Phase.RECORD:
            self._set_action(RouterReplayAction.RECORD)
        elif self._phase is _Phase.REPLAY:
            if index >= len(self._replay):
                raise ReplayError(f"no recorded routing for micro-batch {index} ({len(self._replay)} recorded)")
            if index in self._replayed:
                raise ReplayError(f"routing of micro-batch {index} replayed twice")
            for layer, (inst, idx) in enumerate(zip(self.instances, self._replay[index])):
                if idx.shape != (num_tokens, self.top_k):
                    raise ReplayError(
                        f"micro-batch {index}, MoE layer {self.layer_numbers[layer]}: routing has shape "
                        f"{tuple(idx.shape)}, the pass routes ({num_tokens}, {self.top_k}) tokens on this rank"
                    )
                inst.target_topk_idx = None
                inst.set_target_indices(idx.to(torch.int64))  # megatron gathers with int64: this micro-batch's copies
                if not self._keep_backward:
                    inst.replay_backward_list.clear()
            self._replayed.add(index)
            self._set_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, index: int) -> None:
        if self._phase is _Phase.RECORD:
            self._record[index] = [
                inst.get_recorded_indices().detach().to(self.index_dtype, copy=True) for inst in self.instances
            ]
        elif self._phase is _Phase.REPLAY:
            # an activation-recompute pass during this micro-batch's backward must replay too
            self._set_action(RouterReplayAction.REPLAY_BACKWARD)

    # ---------------------------------------------------------------- helpers

    def _set_action(self, action: RouterReplayAction) -> None:
        for inst in self.instances:
            inst.set_router_replay_action(action)

    def _check_idle(self) -> None:
        if self._phase is not _Phase.IDLE:
            raise ReplayError(f"routing replay is busy ({self._phase.value}); call finish() or recorded() first")

    def _reset(self) -> None:
        for inst in self.instances:
            inst.clear_indices()
            inst.clear_router_replay_action()
        self._phase = _Phase.IDLE


def engine_routing_to_replay(
    routed: Sequence[Tensor | None],
    seq_len: int,
    layer_numbers: Sequence[int],
    top_k: int,
    *,
    num_experts: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    device: torch.device | None = None,
) -> list[Tensor]:
    """One micro-batch's engine routing as this rank's per-layer replay indices (on ``device``:
    by default the routing's).

    ``routed[j]`` is sequence j's ``[n_j, num_layers, k]`` (SGLang: n_j = its length - 1), or
    ``None`` (a sample without routing: an empty response). Positions without engine routing
    (the last token, right padding, such a sample) cannot change any earlier token's
    log-prob; they get ``top_k`` distinct experts that rotate with the position over all
    ``num_experts`` (position p: ``p*k .. p*k+k-1`` mod E), so padding
    spreads over every expert-parallel rank instead of loading the first. Dense layers are
    skipped by taking only ``layer_numbers``; the sequence-parallel slice of this TP rank
    is kept; the result is in megatron's ``[s, b]`` token order, in
    :func:`~moe_rl.routing.encoding.expert_index_dtype` of ``num_experts``.
    """
    b = len(routed)
    device = device or next((r.device for r in routed if r is not None), torch.device("cpu"))
    layers = torch.as_tensor(list(layer_numbers), dtype=torch.long, device=device)
    if not 0 < top_k <= num_experts:
        raise ReplayError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    rotating = (
        torch.arange(seq_len, device=device)[:, None] * top_k + torch.arange(top_k, device=device)
    ) % num_experts
    full = rotating.to(expert_index_dtype(num_experts))[:, None, None, :].expand(seq_len, b, len(layers), top_k).clone()
    top_layer = max(layer_numbers, default=-1)  # from the host list: the device copy's max would sync
    for j, r in enumerate(routed):
        if r is None:
            continue
        n = min(r.shape[0], seq_len)
        if r.shape[-1] != top_k:
            raise ReplayError(f"engine routing has top_k={r.shape[-1]}, the model routes to {top_k}")
        if top_layer >= r.shape[1]:
            raise ReplayError(f"engine routing covers {r.shape[1]} layers, the model has MoE layer {top_layer}")
        full[:n, j] = r[:n].index_select(1, layers)
    local = to_local_tokens(full.transpose(0, 1), tp_rank=tp_rank, tp_size=tp_size, sequence_parallel=sequence_parallel)
    return [local[:, l] for l in range(len(layers))]


def to_local_tokens(x: Tensor, *, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False) -> Tensor:
    """``[b, s, ...]`` per-position values as this rank's routed tokens ``[T_local, ...]``:
    megatron's ``[s, b]`` order, this TP rank's sequence-parallel slice."""
    x = x.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        if x.shape[0] % tp_size:
            raise ReplayError(f"sequence length {x.shape[0]} is not divisible by tp={tp_size} (pad it)")
        per_rank = x.shape[0] // tp_size
        x = x[tp_rank * per_rank : (tp_rank + 1) * per_rank]
    return x.reshape(-1, *x.shape[2:])
