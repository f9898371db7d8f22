"""The default rollout: one engine call per sample (a :class:`~moe_rl.rollout.sampler.Sampler`)."""

from __future__ import annotations

from typing import Any, Sequence

from moe_rl.rollout.types import GroupCallback, RolloutEngine, Sample, SamplingParams


class SingleTurnSampler:
    """One engine call per sample: the default rollout."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def sample(
        self,
        problems: Sequence[Any],
        prompts: Sequence[list[int]],
        n: int,
        params: SamplingParams,
        *,
        seed: int,
        routed: bool,
        on_group: GroupCallback | None = None,
    ) -> list[list[Sample]]:
        if on_group is None:  # engines written before the hand-over take no on_group
            return self.engine.generate(prompts, n, params, seed=seed, return_routed_experts=routed)
        return self.engine.generate(prompts, n, params, seed=seed, return_routed_experts=routed, on_group=on_group)
