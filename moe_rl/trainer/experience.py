"""The first rank's half of a step: prompts -> rollout -> rewards -> advantages.

Advantages are computed over the whole batch here (so GDPO's batch statistics span
every data-parallel rank) before the :class:`Experience` is broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from moe_rl import tags
from moe_rl.algorithms import compute_advantages
from moe_rl.config import Config
from moe_rl.data.tasks import Problem, Task
from moe_rl.rewards import RewardBatch, RewardInput, RewardScorer
from moe_rl.rollout.types import RolloutEngine, Sample, SamplingParams
from moe_rl.trainer.batch import Experience


@dataclass
class ExperienceCollector:
    """Everything the first rank needs to produce a step's :class:`Experience`."""

    cfg: Config
    task: Task
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine
    scorer: RewardScorer
    sampling: SamplingParams
    return_routing: bool  # ask the engine for routed experts (R3, or routing metrics)

    def collect(self, step: int) -> tuple[Experience, dict[str, float]]:
        """The step's experience and its rollout-side scalars (rewards, advantages, lengths)."""
        problems = self.task.problems(self.cfg.train.seed, step, self.cfg.rollout.prompts_per_step)
        prompts, truncated = self._tokenize(problems)
        groups = self.engine.generate(
            prompts,
            self.cfg.rollout.group_size,
            self.sampling,
            seed=self.cfg.train.seed * 100_003 + step,
            return_routed_experts=self.return_routing,
        )
        samples = [s for g in groups for s in g]
        rewards = self.scorer.score(self._reward_inputs(problems, samples))
        advantages = compute_advantages(
            self.cfg.algorithm.advantage, rewards.values, self.cfg.rollout.group_size, weights=rewards.weights
        )
        exp = Experience(samples, rewards.values, rewards.names, advantages)
        return exp, self._scalars(exp, rewards, truncated)

    def _tokenize(self, problems: list[Problem]) -> tuple[list[list[int]], int]:
        """Prompt ids, long ones left-truncated to ``data.max_prompt_tokens`` (counted)."""
        limit = self.cfg.data.max_prompt_tokens
        prompts, truncated = [], 0
        for p in problems:
            ids = self.tokenizer(p.prompt)["input_ids"]
            if len(ids) > limit:
                ids, truncated = ids[-limit:], truncated + 1
            prompts.append(ids)
        return prompts, truncated

    def _reward_inputs(self, problems: list[Problem], samples: list[Sample]) -> list[RewardInput]:
        eos = self.tokenizer.eos_token_id
        inputs = []
        for i, s in enumerate(samples):
            problem = problems[i // self.cfg.rollout.group_size]
            out = s.output_ids[:-1] if s.output_ids and s.output_ids[-1] == eos else s.output_ids
            inputs.append(RewardInput(problem.prompt, self.tokenizer.decode(out), problem.answer, len(s.output_ids)))
        return inputs

    def _scalars(self, exp: Experience, rewards: RewardBatch, truncated: int) -> dict[str, float]:
        samples, advantages = exp.samples, exp.advantages
        grouped = advantages.view(-1, self.cfg.rollout.group_size)
        return {
            tags.REWARD_TOTAL: float(rewards.total().mean()),
            **{tags.reward(n): float(rewards.values[:, j].mean()) for j, n in enumerate(rewards.names)},
            **{tags.reward_failures(n): float(sum(c.values())) for n, c in rewards.failures.items()},
            tags.ADVANTAGE_MEAN: float(advantages.mean()),
            tags.ADVANTAGE_STD: float(advantages.std()) if len(advantages) > 1 else 0.0,
            tags.ADVANTAGE_DISTINCT_PER_GROUP: float(sum(len(set(g.tolist())) for g in grouped) / len(grouped)),
            tags.RESPONSE_LENGTH_MEAN: float(sum(len(s.output_ids) for s in samples) / len(samples)),
            tags.RESPONSE_LENGTH_MAX: float(max(len(s.output_ids) for s in samples)),
            tags.RESPONSE_FINISHED_FRAC: float(sum(s.finish_reason == "stop" for s in samples) / len(samples)),
            tags.DATA_TRUNCATED_PROMPTS: float(truncated),
            tags.DATA_SKIPPED_LINES: float(len(getattr(self.task, "skipped", []))),
        }
