"""The interface the experience collector samples through: :class:`Sampler`, implemented by
the single-turn sampler (:mod:`moe_rl.rollout.single_turn`, one engine call per sample) and
the multi-turn one (:mod:`moe_rl.rollout.multi_turn`, a user's generate function)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from moe_rl.rollout.types import GroupCallback, Sample, SamplingParams


class Sampler(Protocol):
    """``n`` samples of each problem (its prompt ``prompts[i]``), group-major, sample j of
    problem i seeded ``sample_seed(seed, i, j, n)``. ``on_group(i, samples)`` once per
    problem, before ``sample`` returns, as soon as its ``n`` samples are done (the rest
    still generating) or, where the engine cannot tell, at the end: how the experience
    collector scores rewards as groups finish (``reward.score_as_finished``)."""

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
    ) -> list[list[Sample]]: ...
