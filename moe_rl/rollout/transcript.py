"""What a multi-turn generate function builds: the :class:`Turn` an engine call returns and
the :class:`Transcript` of policy turns and environment tokens, made a trainable
:class:`~moe_rl.rollout.types.Sample` (:meth:`Transcript.to_sample`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import Tensor

from moe_rl.rollout.types import TRUNCATED_KEY, Sample, StaleWeightsError, Truncation


class TranscriptError(RuntimeError):
    """A generate function built an inconsistent transcript (a bug in it, not in the environment)."""


@dataclass(frozen=True)
class Turn:
    """One engine call: ``output_ids`` sampled after ``input_ids``; ``routed_experts``
    ``[len(input_ids) + len(output_ids) - 1, layers, k]`` when the run uses routing."""

    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str
    routed_experts: Tensor | None = None


@dataclass
class Transcript:
    """What a generate function returns: the prompt, then policy turns and environment
    tokens. ``response_text`` is what the rewards score (``None``: the decoded output);
    ``meta`` reaches the rewards (``RewardInput.metadata``) and the rollout metrics
    (``tool_calls``, ``tool_failures``, ``truncated``: ``"turns"`` or ``"tokens"``)."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    response_text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    routed_experts: Tensor | None = None  # the last policy turn's: every position up to it
    weight_versions: list[str] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """The prompt and everything after it: what the next turn continues."""
        return self.prompt_ids + self.output_ids

    @property
    def policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def environment_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    def add_policy(self, turn: Turn) -> None:
        """The policy's tokens of ``turn``, which must have continued this transcript."""
        if turn.input_ids != self.token_ids:
            raise TranscriptError(
                "a policy turn must continue the transcript: call engine.generate(transcript.token_ids) and add its turn before anything else"
            )
        if len(turn.logprobs) != len(turn.output_ids):
            raise TranscriptError(
                f"a policy turn has {len(turn.output_ids)} tokens and {len(turn.logprobs)} log-probs: each token "
                "needs its own (an edited turn must cut both)"
            )
        self.output_ids += turn.output_ids
        self.loss_mask += [1] * len(turn.output_ids)
        self.logprobs += turn.logprobs
        self.finish_reason = turn.finish_reason
        self.routed_experts = turn.routed_experts
        self.weight_versions.append(turn.weight_version)

    def add_environment(self, token_ids: Sequence[int]) -> None:
        """Tokens the environment inserted (a tool's result, a user's reply): context only."""
        ids = [int(t) for t in token_ids]
        self.output_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def to_sample(self, seed: int, max_tokens: int | None = None) -> Sample:
        """The transcript as a trainable sample: environment tokens after the last policy
        turn are left out (they would be context for nothing; counted in
        ``dropped_environment_tokens``), and with ``max_tokens`` (the model's context)
        prompt and output are cut to that many (``truncation`` then ``"context"``, else what
        ``meta["truncated"]`` names).
        :class:`TranscriptError` for a transcript that cannot be trained on."""
        self._check()
        end = last_policy_end(self.loss_mask)
        dropped = len(self.loss_mask) - end
        routed = self.routed_experts
        if routed is not None and len(routed) < len(self.prompt_ids) + end - 1:
            raise TranscriptError(
                f"routing covers {len(routed)} positions, the transcript {len(self.prompt_ids) + end - 1}"
            )
        if routed is not None:  # (longer: a last turn cut after it was sampled; routing is causal)
            routed = routed[: len(self.prompt_ids) + end - 1]
        truncation, finish = Truncation.named(self.meta.get(TRUNCATED_KEY)), self.finish_reason
        if max_tokens is not None and len(self.prompt_ids) + end > max_tokens:
            end = last_policy_end(self.loss_mask[: max(0, max_tokens - len(self.prompt_ids))])
            if end == 0:
                raise TranscriptError(f"no policy token of the transcript lies within the model's {max_tokens} tokens")
            routed = routed[: len(self.prompt_ids) + end - 1] if routed is not None else None
            truncation, finish = Truncation.CONTEXT, "length"
        return Sample(
            prompt_ids=list(self.prompt_ids),
            output_ids=self.output_ids[:end],
            output_logprobs=self.logprobs[:end],
            finish_reason=finish,
            weight_version=self.weight_versions[0],
            seed=seed,
            routed_experts=routed,
            meta=dict(self.meta),
            loss_mask=self.loss_mask[:end],
            response_text=self.response_text,
            truncation=truncation,
            dropped_environment_tokens=dropped,
        )

    def _check(self) -> None:
        """:class:`TranscriptError` (or :class:`StaleWeightsError`) for a transcript that
        cannot be trained on."""
        if not self.weight_versions:
            raise TranscriptError(
                "the transcript has no policy turn (add one: transcript.add_policy(await engine.generate(...)))"
            )
        versions = set(self.weight_versions)
        if len(versions) > 1:
            raise StaleWeightsError(f"a multi-turn sample mixes weight versions {sorted(versions)}")
        if not all(math.isfinite(v) for v in self.logprobs):
            raise TranscriptError("a policy turn's log-probs are not finite (NaN or Inf from the engine)")


def last_policy_end(loss_mask: Sequence[int]) -> int:
    """One past the last policy (trained) token of ``loss_mask``; 0 when there is none."""
    return max((i + 1 for i, m in enumerate(loss_mask) if m), default=0)
