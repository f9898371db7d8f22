"""Routing replay over one training step's passes (R2 / R3), on :class:`RoutingReplay`:

    with replay.old_pass(engine_indices) as hooks:   # r2 records, r3 replays the engine's
        old = run_microbatches(model, batches, hooks=hooks)
    with replay.update_pass() as hooks:              # r2/r3 replay what the old pass used
        train_step(..., run_microbatches(..., hooks=hooks))

It changes the forward; what routing did is observed by
:class:`~moe_rl.routing.monitor.RoutingMonitor`, which never changes it."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from megatron.core import parallel_state as ps
from torch import Tensor

from moe_rl.models.forward import MicroBatch, megatron_module
from moe_rl.routing.replay import RoutingReplay, engine_routing_to_replay, moe_layers

REPLAYING_MODES = ("r2", "r3")  # the old policy's routing | the inference engine's


class StepReplay:
    """``mode`` r2: the old pass records each MoE layer's top-k, the update passes replay it;
    r3: every pass replays the engine's routing. ``recompute``: activation recompute in
    the backward replays it too."""

    def __init__(self, model: torch.nn.Module, mode: str, *, recompute: bool = False) -> None:
        if mode not in REPLAYING_MODES:
            raise ValueError(f"routing replay mode {mode!r} replays nothing; valid: {', '.join(REPLAYING_MODES)}")
        self.mode = mode
        self.replay = RoutingReplay(model, recompute=recompute)
        self.indices: list[list[Tensor]] = []  # per micro-batch, per MoE layer: what the update passes replay

    @contextlib.contextmanager
    def old_pass(self, engine_indices: Sequence[Sequence[Tensor]] | None) -> Iterator[list]:
        """The old-policy pass; ``engine_indices`` (:func:`engine_indices`; required for r3)."""
        if self.mode == "r3":
            if engine_indices is None:
                raise ValueError("routing replay r3 needs the rollout engine's routing (return_routed_experts)")
            self.indices = [list(mb) for mb in engine_indices]
            self.replay.start_replay(self.indices, forward_only=True)
        else:
            self.replay.start_record()
        with self._abort_on_error():
            yield [self.replay]
        if self.mode == "r2":
            self.indices = self.replay.recorded()
        else:
            self.replay.finish()

    @contextlib.contextmanager
    def update_pass(self) -> Iterator[list]:
        """One policy-update pass (forward and backward) replaying :attr:`indices`."""
        self.replay.start_replay(self.indices)
        with self._abort_on_error():
            yield [self.replay]
        self.replay.finish()

    def release(self) -> None:
        """Drop the step's indices (device memory, until the next old pass otherwise)."""
        self.indices = []

    @contextlib.contextmanager
    def _abort_on_error(self) -> Iterator[None]:
        """A pass that raised leaves replay idle."""
        try:
            yield
        except BaseException:
            self.replay.abort()
            raise


def engine_routed_positions(batches: Sequence[MicroBatch], routed: Sequence[Sequence[Tensor | None]]) -> list[Tensor]:
    """Per micro-batch ``[b, s]``: 1 at the positions the engine returned routing for
    (``routed[i][j]``'s first rows), 0 where :func:`engine_indices` holds filler (the last
    token, padding, every position of a sample without routing: an empty response)."""
    out = []
    for mb, routed_mb in zip(batches, routed):
        seq_len, device = mb.input_ids.shape[1], mb.input_ids.device
        counts = torch.tensor([0 if r is None else min(r.shape[0], seq_len) for r in routed_mb], device=device)
        out.append((torch.arange(seq_len, device=device)[None, :] < counts[:, None]).to(torch.float32))
    return out


def engine_indices(
    model: torch.nn.Module,
    batches: Sequence[MicroBatch],
    routed: Sequence[Sequence[Tensor | None]],
    num_experts: int,
) -> list[list[Tensor]]:
    """``routed[i][j]`` (micro-batch i, sequence j: the engine's ``[n, num_layers, k]``, or
    ``None``: none) as this rank's per-layer indices in megatron's token order (its stage's
    MoE layers, its sequence-parallel slice): what R3 replays and what the drift metrics
    compare with. A stage without MoE layers (a pipeline stage of dense layers) has none."""
    layers = moe_layers(model)
    if not layers:
        return [[] for _ in batches]
    numbers, top_k = [n for n, _ in layers], (layers[0][1].topk if layers else 0)
    config = megatron_module(model).config
    return [
        engine_routing_to_replay(
            routed_mb,
            mb.input_ids.shape[1],
            numbers,
            top_k,
            num_experts=num_experts,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            sequence_parallel=config.sequence_parallel,
            device=mb.input_ids.device,
        )
        for mb, routed_mb in zip(batches, routed)
    ]
