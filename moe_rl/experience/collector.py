"""The first rank's half of a step: prompts -> rollout -> rewards -> advantages.

Advantages are computed over the whole batch here (so GDPO's batch statistics span
every data-parallel rank) before the :class:`Experience` is broadcast. With DAPO's dynamic
sampling (``rollout.dynamic_sampling``) groups whose samples all got the same
rewards are dropped and more prompts sampled, up to ``rollout.dynamic_sampling.max_rounds``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from moe_rl import tags
from moe_rl.algorithms import compute_advantages
from moe_rl.data.prompts import PromptFormatter
from moe_rl.data.tasks import Problem, Task
from moe_rl.rewards import RewardBatch, RewardInput, RewardScorer
from moe_rl.rollout.partial import PartialRollout, PartialStep
from moe_rl.rollout.sampler import Sampler
from moe_rl.rollout.settings import RolloutConfig
from moe_rl.rollout.types import RolloutEngine, Sample, SampleStatus, SamplingParams, StaleWeightsError
from moe_rl.experience.multi_turn_batch import failed, multi_turn_scalars, stop_if_failed
from moe_rl.experience.types import Experience

log = logging.getLogger("moe_rl.train")


@dataclass
class SampledRound:
    """One round of generation: its problems, samples (prompt-major) and rewards."""

    problems: list[Problem]
    samples: list[Sample]
    rewards: RewardBatch
    truncated: int  # prompts left-truncated to data.max_prompt_tokens


def generate_and_score(
    problems: list[Problem],
    formatter: PromptFormatter,
    sampler: Sampler,
    scorer: RewardScorer,
    sampling: SamplingParams,
    group_size: int,
    seed: int,
    return_routing: bool = False,
) -> SampledRound:
    """``group_size`` responses to each problem, scored (training and evaluation alike): at
    the end, or (``scorer.score_as_finished``) each group as soon as it is done, while the
    rest still generate. A multi-turn sample whose generate function failed scores 0 in every reward."""
    encoded = formatter.encode_all(problems)
    prompts = [ids for ids, _ in encoded]
    inputs = functools.partial(
        _reward_inputs,
        tokenizer=formatter.tokenizer,
        keep_special_tokens=scorer.keep_special_tokens,
        max_new_tokens=sampling.max_new_tokens,
    )
    if scorer.score_as_finished:
        pending: dict[int, Future] = {}

        def score_group(i: int, group: list[Sample]) -> None:  # on the generating thread: hand over, return
            if i in pending:
                raise RuntimeError(f"the sampler handed over group {i} twice")
            pending[i] = scorer.submit(inputs([problems[i]] * len(group), group))

        groups = sampler.sample(
            problems, prompts, group_size, sampling, seed=seed, routed=return_routing, on_group=score_group
        )
        for i, group in enumerate(groups):  # any the sampler did not hand over (it must not, but scores stay whole)
            if i not in pending:
                score_group(i, group)
        rewards = scorer.gather([pending[i] for i in range(len(groups))])
        samples = [s for g in groups for s in g]
    else:
        groups = sampler.sample(problems, prompts, group_size, sampling, seed=seed, routed=return_routing)
        samples = [s for g in groups for s in g]
        rewards = scorer.score(inputs([problems[i // group_size] for i in range(len(samples))], samples))
    return SampledRound(problems, samples, _failed_score_zero(samples, rewards), sum(t for _, t in encoded))


def _failed_score_zero(samples: list[Sample], rewards: RewardBatch) -> RewardBatch:
    failed = [i for i, s in enumerate(samples) if s.status is SampleStatus.FAILED]
    if failed:
        rewards.values[failed] = 0.0
    return rewards


def _reward_inputs(
    problems: list[Problem], samples: list[Sample], *, tokenizer, keep_special_tokens: bool, max_new_tokens: int
) -> list[RewardInput]:
    """What the rewards see of each sample (``samples[k]`` answers ``problems[k]``)."""
    texts = _response_texts(samples, tokenizer, keep_special_tokens)
    return [
        RewardInput(p.prompt, text, p.answer, s.policy_token_count, max_new_tokens, s.reward_metadata())
        for p, s, text in zip(problems, samples, texts)
    ]


def _response_texts(samples: list[Sample], tokenizer, keep_special_tokens: bool = False) -> list[str]:
    """What the rewards score: a transcript's ``response_text``, else the decoded output,
    its special tokens skipped (``keep_special_tokens``: kept, but for a final EOS)."""
    eos = tokenizer.eos_token_id
    decoded = tokenizer.batch_decode(
        [s.output_ids[:-1] if s.output_ids and s.output_ids[-1] == eos else s.output_ids for s in samples],
        skip_special_tokens=not keep_special_tokens,
    )
    return [s.response_text if s.response_text is not None else text for s, text in zip(samples, decoded)]


@dataclass
class ExperienceCollector:
    """Everything the first rank needs to produce a step's :class:`Experience`."""

    rollout: RolloutConfig
    advantage: str  # algorithm.advantage: the estimator's registered name
    seed: int  # train.seed: the problems and sampling seeds of each step and round
    task: Task
    formatter: PromptFormatter
    engine: RolloutEngine
    sampler: Sampler  # one call per sample, or the run's generate function (multi-turn)
    scorer: RewardScorer
    sampling: SamplingParams
    return_routing: bool  # ask the engine for routed experts (R3, or routing metrics)
    partial: PartialRollout | None = None  # partial rollouts: the groups carried between steps

    def _sample_partial(self, step: int) -> tuple[SampledRound, dict[str, float]]:
        """Step ``step``'s groups with partial rollouts (carried ones continued, fresh
        prompts started) and rewards, scored once generation ends; the carry's figures."""
        assert self.partial is not None
        problems = self.task.problems(self.seed, step, self.partial.fresh_groups_wanted())
        encoded = self.formatter.encode_all(problems)
        got = self.partial.sample(
            problems,
            [ids for ids, _ in encoded],
            self.sampling,
            seed=self.seed * 100_003 + step,
            step=step,
            routed=self.return_routing,
        )
        samples = [s for g in got.groups for s in g]
        inputs = _reward_inputs(
            [p for p in got.problems for _ in range(self.rollout.group_size)],
            samples,
            tokenizer=self.formatter.tokenizer,
            keep_special_tokens=self.scorer.keep_special_tokens,
            max_new_tokens=self.sampling.max_new_tokens,
        )
        rewards = _failed_score_zero(samples, self.scorer.score(inputs))
        sampled = SampledRound(got.problems, samples, rewards, sum(t for _, t in encoded))
        return sampled, partial_scalars(samples, step, got)

    def partial_state(self, step: int) -> list[dict] | None:
        """The carried groups step ``step``'s generation starts from, as plain data (for a
        checkpoint after ``step`` steps); ``None`` without partial rollouts."""
        if self.partial is None:
            return None
        return [{**g, "problem": dataclasses.asdict(g["problem"])} for g in self.partial.state_for(step)]

    def load_partial_state(self, state: list[dict]) -> None:
        """What :meth:`partial_state` gave (a resumed run)."""
        if self.partial is not None:
            self.partial.load_state([{**g, "problem": _problem(g["problem"])} for g in state])

    def collect(self, step: int) -> tuple[Experience, dict[str, float]]:
        """The step's experience and its rollout-side scalars (rewards, advantages, lengths)."""
        r = self.rollout
        if self.partial is not None:
            sampled, carry = self._sample_partial(step)
            exp = self._experience([sampled], [(0, g) for g in range(r.prompts_per_step)])
            return exp, {**self._scalars(exp, [sampled], r.prompts_per_step), **carry}
        rounds, kept = [], []  # kept: (round, group) of the groups trained on
        for k in range(r.dynamic_sampling.max_rounds if r.dynamic_sampling.enabled else 1):
            rounds.append(self._sample(step, k))
            stop_if_failed(rounds[-1].samples, r.multi_turn.max_failed_frac, step, r.multi_turn.generate_fn)
            kept += [(k, g) for g in self._groups_to_keep(rounds[-1])]
            if len(kept) >= r.prompts_per_step:
                break
        kept_by_filter = len(kept)
        if not kept:  # every group of every round had equal rewards: train on the first round
            log.warning(
                "step %d: every sampled group had equal rewards (zero advantage) in %d rounds", step + 1, len(rounds)
            )
            kept = [(0, g) for g in range(r.prompts_per_step)]
        exp = self._experience(rounds, kept[: r.prompts_per_step])
        return exp, self._scalars(exp, rounds, kept_by_filter)

    def _experience(self, rounds: list[SampledRound], kept: list[tuple[int, int]]) -> Experience:
        """The groups ``kept`` ((round, group) pairs) with their advantages."""
        samples, values = self._select(rounds, kept)
        rewards = rounds[0].rewards
        advantages = compute_advantages(
            self.advantage, values, self.rollout.group_size, weights=rewards.weights, valid=self._valid(samples)
        )
        return Experience(samples, values, rewards.names, advantages)

    def _sample(self, step: int, round_: int) -> SampledRound:
        """Round ``round_`` of step ``step``: the task's problems for (seed, step), from
        another seed in later rounds (deterministic, so a resumed run samples the same)."""
        seed = self.seed + 1_000_003 * round_
        problems = self.task.problems(seed, step, self.rollout.prompts_per_step)
        return generate_and_score(
            problems,
            self.formatter,
            self.sampler,
            self.scorer,
            self.sampling,
            self.rollout.group_size,
            seed=seed * 100_003 + step,
            return_routing=self.return_routing,
        )

    def _valid(self, samples: list[Sample]) -> list[bool] | None:
        """The samples that enter their group's advantage statistics: every one
        (``rollout.multi_turn.failed_samples=zero``: ``None``), or those that did not fail (``drop``)."""
        if self.rollout.multi_turn.failed_samples == "zero":
            return None
        return [not f for f in failed(samples)]

    def _groups_to_keep(self, sampled: SampledRound) -> list[int]:
        """Every group, or (dynamic sampling) those whose samples' rewards are not all equal
        as the advantage estimator sees them: GDPO each reward column, the others the weighted
        total (two samples scoring (1, 0) and (0, 1) at equal weights give GRPO zero advantage)
        (``rollout.multi_turn.failed_samples=drop``: among the samples that did not fail)."""
        g = self.rollout.group_size
        values = sampled.rewards.values
        if not self.rollout.dynamic_sampling.enabled:
            return list(range(len(values) // g))
        if self.advantage != "gdpo":
            values = sampled.rewards.total().unsqueeze(1)
        dropped = failed(sampled.samples) if self.rollout.multi_turn.failed_samples == "drop" else [False] * len(values)
        rows = [
            [v for v, f in zip(values[i : i + g].tolist(), dropped[i : i + g]) if not f]
            for i in range(0, len(values), g)
        ]
        return [i for i, group in enumerate(rows) if len({tuple(v) for v in group}) > 1]

    def _select(self, rounds: list[SampledRound], kept: list[tuple[int, int]]) -> tuple[list[Sample], torch.Tensor]:
        g = self.rollout.group_size
        samples = [s for k, i in kept for s in rounds[k].samples[i * g : (i + 1) * g]]
        values = torch.cat([rounds[k].rewards.values[i * g : (i + 1) * g] for k, i in kept])
        return samples, values

    def _scalars(self, exp: Experience, rounds: list[SampledRound], kept_groups: int) -> dict[str, float]:
        """Rewards over every sample generated this step; the rest over the trained batch."""
        samples, advantages = exp.all_samples, exp.advantages
        grouped = advantages.view(-1, self.rollout.group_size)
        everything = RewardBatch.concat([rd.rewards for rd in rounds])
        trained = RewardBatch(exp.rewards, everything.names, everything.weights)
        totals = trained.total().view(-1, self.rollout.group_size)
        scalars = {
            tags.REWARD_TOTAL: float(everything.total().mean()),
            **{tags.reward(n): float(everything.values[:, j].mean()) for j, n in enumerate(everything.names)},
            **{tags.reward_failures(n): float(sum(c.values())) for n, c in everything.failures.items()},
            tags.ADVANTAGE_MEAN: float(advantages.mean()),
            tags.ADVANTAGE_STD: float(advantages.std()) if len(advantages) > 1 else 0.0,
            tags.ADVANTAGE_DISTINCT_PER_GROUP: float(sum(len(set(g)) for g in grouped.tolist()) / len(grouped)),
            tags.REWARD_DISTINCT_TOTALS_PER_GROUP: float(sum(len(set(t)) for t in totals.tolist()) / len(totals)),
            **response_scalars([s for s in samples if s.status is not SampleStatus.FAILED]),
            tags.DATA_TRUNCATED_PROMPTS: float(sum(rd.truncated for rd in rounds)),
            tags.DATA_SKIPPED_LINES: float(len(self.task.skipped)),
        }
        scalars.update(multi_turn_scalars([s for rd in rounds for s in rd.samples]))
        scalars.update(self.engine.rollout_scalars())
        if self.rollout.dynamic_sampling.enabled:
            scalars[tags.DATA_KEPT_GROUP_FRAC] = kept_groups / sum(len(rd.problems) for rd in rounds)
            scalars[tags.DATA_SAMPLING_ROUNDS] = float(len(rounds))
        return scalars


def response_scalars(samples: list[Sample]) -> dict[str, float]:
    """``response/*`` over ``samples`` (those that did not fail: a failed one trains nothing)."""
    n = max(len(samples), 1)
    return {
        tags.RESPONSE_LENGTH_MEAN: float(sum(s.policy_token_count for s in samples) / n),
        tags.RESPONSE_LENGTH_MAX: float(max((s.policy_token_count for s in samples), default=0)),
        tags.RESPONSE_FINISHED_FRAC: float(sum(s.finish_reason == "stop" for s in samples) / n),
    }


def partial_scalars(samples: list[Sample], step: int, got: PartialStep) -> dict[str, float]:
    """``rollout/partial/*`` and ``rollout/staleness/*`` of step ``step``'s trained samples
    (weight version ``str(v)``: ``step - v`` versions behind the weights they train)."""
    behind = [step - int(v) for s in samples for v, m in zip(s.token_versions(), s.output_mask()) if m]
    tokens = max(len(behind), 1)
    return {
        tags.PARTIAL_SAMPLE_FRAC: sum(len(s.segments) > 1 for s in samples) / max(len(samples), 1),
        tags.PARTIAL_RESTARTED: float(got.restarted),
        tags.PARTIAL_CARRIED_GROUPS: float(got.carried),
        tags.PARTIAL_CARRIED_TOKENS: float(got.carried_tokens),
        tags.TOKEN_STALENESS_MEAN: sum(behind) / tokens,
        tags.TOKEN_STALENESS_MAX: float(max(behind, default=0)),
        **{tags.tokens_at_staleness(k): behind.count(k) / tokens for k in sorted(set(behind))},
    }


def _problem(d: dict) -> Problem:
    """A :class:`Problem` from its ``dataclasses.asdict``."""
    messages = d.get("messages")
    return Problem(d["prompt"], d["answer"], tuple(messages) if messages is not None else None)


def policy_lag(exp: Experience, step: int, max_lag: int) -> float:
    """How many updates behind step ``step``'s weights (version ``str(step)``) the weights
    that generated ``exp`` were; :class:`StaleWeightsError` beyond ``max_lag`` (or for a
    version the trainer never synced)."""
    try:
        lags = {step - int(s.weight_version) for s in exp.all_samples}
    except ValueError:
        versions = sorted({s.weight_version for s in exp.all_samples})
        raise StaleWeightsError(
            f"step {step + 1}: samples of weight versions {versions}, which the trainer never synced"
        ) from None
    if min(lags) < 0 or max(lags) > max_lag:
        raise StaleWeightsError(
            f"step {step + 1}: samples are {sorted(lags)} updates behind the trained weights (at most {max_lag} allowed)"
        )
    return float(max(lags))
