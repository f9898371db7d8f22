"""Where the trainer's state and the rollout engine live between phases of a step, chosen
once per run: on devices of their own (nothing moves), or colocated on the same GPUs
(``rollout.colocate``), where one side's memory is released while the other works, in
the order slime and verl use:

    rollout (engine holds its memory; trainer weights, grads, optimizer in host memory)
    -> for_training: engine releases all its memory; trainer state back on the GPU
    -> update
    -> for_rollout: grads + optimizer to host; engine takes back its weights memory;
       weights synced; trainer weights to host; engine takes back its KV cache and CUDA graphs

Every memory kind is named when released, and every released kind is taken back: SGLang
releases ``weights``, ``kv_cache`` and ``cuda_graph`` when asked with no tags, and a
decode that replays CUDA graphs whose memory is still released reads unmapped memory.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Protocol

from moe_rl.config import Config
from moe_rl.rollout.contracts import MemoryReleaser, require_capability
from moe_rl.rollout.types import RolloutEngine
from moe_rl.trainer.policy import Policy
from parallel.collectives import barrier
from parallel.offload import DeviceOffloader

ENGINE_MEMORY = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory-saver tags


class Placement(Protocol):
    def for_training(self) -> None:
        """Collective: the trainer's state is on its devices."""

    def for_rollout(self, sync_weights: Callable[[], None]) -> None:
        """Collective: ``sync_weights()`` runs, and the engine can generate afterwards."""

    def trainer_resident(self, sync_weights: Callable[[], None]) -> contextlib.AbstractContextManager:
        """Collective: the trainer's whole state is on its devices inside (checkpoints);
        the engine is ready to generate again afterwards."""


class SeparatePlacement:
    """Trainer and engine on devices of their own: nothing moves."""

    def for_training(self) -> None:
        pass

    def for_rollout(self, sync_weights: Callable[[], None]) -> None:
        sync_weights()

    def trainer_resident(self, sync_weights: Callable[[], None]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Colocation:
    """Trainer and SGLang servers share GPUs. ``engine``: an
    :class:`moe_rl.rollout.sglang.engine.SGLangEngine` on the first rank, ``None`` elsewhere.
    Made after :meth:`free_engine_memory`, which runs before the trainer builds its state."""

    def __init__(self, engine: RolloutEngine | None, offloader: DeviceOffloader) -> None:
        self.engine = require_capability(engine, MemoryReleaser, "rollout.colocate=true")
        self.offloader = offloader
        self.released: set[str] = set(ENGINE_MEMORY)  # the engine memory kinds released now (first rank)

    @staticmethod
    def free_engine_memory(engine: RolloutEngine | None) -> None:
        """Collective, at start-up: the servers (started, and sized, on free GPUs) release
        all their memory before any rank builds its model, DDP buffers and masters."""
        releaser = require_capability(engine, MemoryReleaser, "rollout.colocate=true")
        if releaser is not None:
            releaser.release_memory_occupation(ENGINE_MEMORY)
        barrier()

    def for_training(self) -> None:
        held = [kind for kind in ENGINE_MEMORY if kind not in self.released]
        if self.engine is not None and held:
            self.engine.release_memory_occupation(held)
            self.released.update(held)
        barrier()  # no rank reloads before the engine has freed the node's memory
        self.offloader.onload()

    def for_rollout(self, sync_weights: Callable[[], None]) -> None:
        self.offloader.offload(["grads", "optimizer"])
        barrier()
        self._resume(["weights"])
        sync_weights()  # collective: reads the trainer's weights, still on the device
        self.offloader.offload(["weights"])
        barrier()
        self._resume(["kv_cache", "cuda_graph"])

    @contextlib.contextmanager
    def trainer_resident(self, sync_weights: Callable[[], None]) -> Iterator[None]:
        was_offloaded = bool(self.offloader.offloaded())
        if was_offloaded:
            self.for_training()
        yield
        if was_offloaded:  # a released engine's weights are gone: they are synced again
            self.for_rollout(sync_weights)

    def _resume(self, kinds: list[str]) -> None:
        released = [kind for kind in kinds if kind in self.released]
        if self.engine is not None and released:
            self.engine.resume_memory_occupation(released)
            self.released.difference_update(released)


def make_room_for_the_trainer(cfg: Config, engine: RolloutEngine | None) -> None:
    """Collective, before the trainer builds its model: colocated servers (``rollout.colocate``)
    release all their GPU memory; separate ones keep theirs."""
    if cfg.rollout.colocate:
        Colocation.free_engine_memory(engine)


def build_placement(cfg: Config, engine: RolloutEngine | None, policy: Policy) -> Placement:
    """``rollout.colocate``: trainer and SGLang servers take turns on the same GPUs."""
    if not cfg.rollout.colocate:
        return SeparatePlacement()
    return Colocation(engine, DeviceOffloader([policy.model], policy.optimizer))
