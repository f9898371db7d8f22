"""One step's experience: what the first rank collected (samples, rewards, advantages),
sent out to the data-parallel ranks in shares, with the totals every rank needs."""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence

from torch import Tensor

from moe_rl.rollout.types import Sample


@dataclass(frozen=True)
class StepTotals:
    """What every rank needs to know of all of a step's samples (not only its share)."""

    lengths: list[int]  # prompt + response tokens of each sample
    num_response_tokens: int  # the policy's own (trained) tokens
    num_responses: int  # samples with at least one such token
    routing_shape: tuple[int, int] | None  # (layers, k) of the engine's routed experts, if any

    @classmethod
    def of(cls, samples: Sequence[Sample | None]) -> StepTotals:
        """The totals of a whole step's ``samples`` (a share, which lacks other ranks', has
        its totals given)."""
        whole = [s for s in samples if s is not None]
        if len(whole) != len(samples):
            raise ValueError("a step's totals need all of its samples; a share gets them from the first rank")
        routed = next((s.routed_experts for s in whole if s.routed_experts is not None), None)
        return cls(
            [len(s.prompt_ids) + len(s.output_ids) for s in whole],
            sum(s.policy_token_count for s in whole),
            sum(1 for s in whole if s.policy_token_count),
            (routed.shape[1], routed.shape[2]) if routed is not None else None,
        )


@dataclass
class Experience:
    """What the first rank collected for a step (every sample), or a data-parallel rank's
    share of it (:mod:`moe_rl.trainer.experience_transport`: ``None`` where another rank's
    samples are; the step's totals are always whole)."""

    samples: Sequence[Sample | None]  # flat, prompt-major (group members contiguous)
    rewards: Tensor  # [B, n_rewards] (first rank; zeros in a share)
    reward_names: list[str]
    advantages: Tensor  # [B]
    totals: StepTotals | None = None  # computed from ``samples`` when not given

    def __post_init__(self) -> None:
        if self.totals is None:
            self.totals = StepTotals.of(self.samples)

    @property
    def step_totals(self) -> StepTotals:
        """The whole step's totals (set at construction)."""
        assert self.totals is not None
        return self.totals

    @property
    def all_samples(self) -> list[Sample]:
        """Every sample of the step (the first rank's experience; a share lacks some)."""
        return [self.sample(i) for i in range(len(self.samples))]

    def sample(self, i: int) -> Sample:
        """Sample ``i``, which this rank must hold (the first rank holds every one)."""
        s = self.samples[i]
        if s is None:
            raise ValueError(f"sample {i} is another data-parallel rank's")
        return s

    @property
    def num_response_tokens(self) -> int:
        return self.step_totals.num_response_tokens

    @property
    def num_responses(self) -> int:
        """Samples with at least one response token."""
        return self.step_totals.num_responses

    @property
    def num_tokens(self) -> int:
        """Prompt and response tokens of every sample."""
        return sum(self.step_totals.lengths)

    @property
    def lengths(self) -> list[int]:
        """Prompt + response tokens of each sample."""
        return self.step_totals.lengths
