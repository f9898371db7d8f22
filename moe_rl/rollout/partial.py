"""Partial rollouts (``rollout.partial``): a step's generation ends as soon as the groups it
trains on are done. The responses still running then are stopped with the tokens they have
(SGLang's ``/abort_request``; the local engine at that decode step), carried over, and
continued in a later step's generation, after the weight update, from prompt + partial
response (slime's ``--partial-rollout``): a step no longer waits for its longest responses.

A continued response is a chain of :class:`~moe_rl.rollout.types.Segment`: each output token
keeps the weight version that drew it, its log-prob under those weights and the routing
those weights chose; the continuation's prefill of the earlier tokens (new weights) returns
no routing, so R3 replays each position's own engine choice. A carried response whose oldest
token would be more than ``rollout.max_staleness`` versions behind the weights it trains is
started over. Carried groups are oldest first: they fill a step before fresh prompts do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from moe_rl.rollout.types import GenerationRequest, RolloutEngine, Sample, SamplingParams, Segment, sample_seed


@dataclass
class CarriedGroup:
    """A prompt's group between steps: members done, partial (``"abort"``), or not started."""

    problem: Any
    samples: list[Sample]

    def done(self) -> bool:
        return all(s.finish_reason != "abort" for s in self.samples)


@dataclass
class PartialStep:
    """What one step's generation gave: the groups to train on and its figures."""

    problems: list[Any]
    groups: list[list[Sample]]
    restarted: int  # carried responses started over: older than rollout.max_staleness allows
    carried: int  # groups carried on to a later step
    carried_tokens: int  # their output tokens so far


class PartialRollout:
    """The carried groups of a run and the generation that continues them."""

    def __init__(
        self, engine: RolloutEngine, group_size: int, groups_per_step: int, extra_groups: int, max_staleness: int
    ) -> None:
        self.engine = engine
        self.group_size, self.groups_per_step = group_size, groups_per_step
        self.extra_groups, self.max_staleness = extra_groups, max_staleness
        self.carried: list[CarriedGroup] = []
        self._before: dict[int, list[CarriedGroup]] = {}  # the carry as each step's generation found it

    def fresh_groups_wanted(self) -> int:
        """How many new prompts the next step's generation starts."""
        return max(0, self.groups_per_step + self.extra_groups - len(self.carried))

    def sample(
        self,
        problems: Sequence[Any],
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        seed: int,
        step: int,
        routed: bool,
    ) -> PartialStep:
        """Step ``step``'s groups (``step`` is also the version its weights will have):
        carried ones continued, ``problems`` (prompted ``prompts``) started, until
        ``groups_per_step`` are done; the rest carried on."""
        self._before = {step: list(self.carried), **{s: c for s, c in self._before.items() if s > step - 2}}
        restarted = 0
        groups = []
        for group in self.carried:
            fresh, count = self._within_staleness(group, step)
            groups.append(fresh)
            restarted += count
        n = self.group_size
        for i, (problem, prompt) in enumerate(zip(problems, prompts)):
            members = [_unstarted(prompt, sample_seed(seed, i, j, n), self.engine.weight_version) for j in range(n)]
            groups.append(CarriedGroup(problem, members))
        self._generate(groups, params, routed)
        done = [g for g in groups if g.done()][: self.groups_per_step]
        self.carried = [g for g in groups if not any(g is d for d in done)]
        return PartialStep(
            [g.problem for g in done],
            [g.samples for g in done],
            restarted,
            len(self.carried),
            sum(len(s.output_ids) for g in self.carried for s in g.samples),
        )

    def _generate(self, groups: list[CarriedGroup], params: SamplingParams, routed: bool) -> None:
        """Continue every unfinished member until ``groups_per_step`` groups are done."""
        needed = self.groups_per_step - sum(g.done() for g in groups)
        where = [(gi, j) for gi, g in enumerate(groups) for j, s in enumerate(g.samples) if s.finish_reason == "abort"]
        if needed <= 0 or not where:
            return
        requests, settings = [], []
        for gi, j in where:
            s = groups[gi].samples[j]
            requests.append(GenerationRequest(s.prompt_ids + s.output_ids, s.seed, gi, generated=len(s.output_ids)))
            settings.append(dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(s.output_ids)))
        outs = self.engine.generate_requests(requests, settings, routed=routed, groups_needed=needed)
        for (gi, j), out in zip(where, outs):
            groups[gi].samples[j] = joined(groups[gi].samples[j], out)

    def _within_staleness(self, group: CarriedGroup, step: int) -> tuple[CarriedGroup, int]:
        """``group`` with every member whose oldest token is more than ``max_staleness``
        versions behind ``step`` started over; how many were."""
        members, restarted = [], 0
        for s in group.samples:
            if s.output_ids and step - int(s.weight_version) > self.max_staleness:
                s, restarted = _unstarted(s.prompt_ids, s.seed, self.engine.weight_version), restarted + 1
            members.append(s)
        return CarriedGroup(group.problem, members), restarted

    # ------------------------------------------------------------ checkpoints

    def state_for(self, step: int) -> list[dict]:
        """The carry step ``step``'s generation starts from (for a checkpoint after
        ``step`` steps: a run resumed there generates step ``step`` again), as plain data."""
        return [
            {"problem": g.problem, "samples": [_sample_state(s) for s in g.samples]}
            for g in self._before.get(step, self.carried)
        ]

    def load_state(self, state: list[dict]) -> None:
        """The carry :meth:`state_for` gave."""
        self.carried = [CarriedGroup(g["problem"], [_sample_from_state(s) for s in g["samples"]]) for g in state]
        self._before = {}


def joined(earlier: Sample, later: Sample) -> Sample:
    """``earlier`` (a partial response) continued by ``later`` (the tokens generated from
    its prompt + output on): tokens, log-probs and routing appended, each segment keeping
    its own weight version."""
    if not later.output_ids:
        return earlier
    if not earlier.output_ids:
        return dataclasses.replace(later, prompt_ids=earlier.prompt_ids, seed=earlier.seed)
    first = earlier.segments or (Segment(0, earlier.weight_version),)
    segments = (
        first
        if first[-1].weight_version == later.weight_version
        else (*first, Segment(len(earlier.output_ids), later.weight_version))
    )
    routing = None
    if earlier.routed_experts is not None and later.routed_experts is not None:
        routing = torch.cat([earlier.routed_experts, later.routed_experts])
    return Sample(
        prompt_ids=earlier.prompt_ids,
        output_ids=earlier.output_ids + later.output_ids,
        output_logprobs=earlier.output_logprobs + later.output_logprobs,
        finish_reason=later.finish_reason,
        weight_version=segments[0].weight_version,
        seed=earlier.seed,
        routed_experts=routing,
        segments=segments if len(segments) > 1 else (),
    )


def _unstarted(prompt: list[int], seed: int, version: str) -> Sample:
    return Sample(list(prompt), [], [], "abort", version, seed)


def _sample_state(s: Sample) -> dict:
    return {
        "prompt_ids": s.prompt_ids,
        "output_ids": s.output_ids,
        "output_logprobs": s.output_logprobs,
        "finish_reason": s.finish_reason,
        "weight_version": s.weight_version,
        "seed": s.seed,
        "routed_experts": s.routed_experts,
        "segments": [(seg.start, seg.weight_version) for seg in s.segments],
    }


def _sample_from_state(d: dict) -> Sample:
    return Sample(
        prompt_ids=list(d["prompt_ids"]),
        output_ids=list(d["output_ids"]),
        output_logprobs=list(d["output_logprobs"]),
        finish_reason=d["finish_reason"],
        weight_version=d["weight_version"],
        seed=int(d["seed"]),
        routed_experts=d["routed_experts"],
        segments=tuple(Segment(int(a), str(b)) for a, b in d["segments"]),
    )
