"""Evaluation on held-out problems: ``samples`` responses per prompt from the rollout
engine, scored by the run's rewards; pass@1 and pass@k (the unbiased estimator of Chen et
al. 2021) over one reward's "solved" (>= 1), and the mean rewards."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_rl import tags
from moe_rl.config import Config
from moe_rl.data.prompts import PromptFormatter
from moe_rl.data.tasks import Problem, Task
from moe_rl.rewards import RewardBatch, RewardScorer
from moe_rl.rollout.sampler import Sampler
from moe_rl.rollout.types import SampleStatus, SamplingParams
from moe_rl.experience.collector import generate_and_score

EVAL_SEED = 20_261_130  # the same sampling seeds at every evaluation: runs and steps compare on equal terms
SOLVED_AT = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that ``k`` of ``n`` responses, ``c`` of them correct, drawn without
    replacement, hold a correct one: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class Evaluator:
    """Evaluates whatever weights ``engine`` serves on ``problems``."""

    problems: list[Problem]
    formatter: PromptFormatter
    sampler: Sampler  # the run's rollout (single- or multi-turn) over its engine
    scorer: RewardScorer
    sampling: SamplingParams
    samples: int  # responses per prompt (k of pass@k)
    solved_reward: str  # a reward column of ``scorer``
    prompts_per_request: int = 32
    progress: bool = True

    def run(self, desc: str = "eval") -> dict[str, float]:
        """``eval/*`` scalars: pass@1, pass@<samples>, mean total and per-reward, length."""
        from tqdm import tqdm

        rewards, lengths = [], []
        with tqdm(total=len(self.problems), desc=desc, unit="prompt", disable=not self.progress, leave=False) as bar:
            for start in range(0, len(self.problems), self.prompts_per_request):
                chunk = self.problems[start : start + self.prompts_per_request]
                sampled = generate_and_score(
                    chunk,
                    self.formatter,
                    self.sampler,
                    self.scorer,
                    self.sampling,
                    self.samples,
                    seed=EVAL_SEED + start,
                )
                rewards.append(sampled.rewards)
                # a failed sample's length is 0 (nothing of it is the policy's): it would only dilute the mean
                lengths += [s.policy_token_count for s in sampled.samples if s.status is not SampleStatus.FAILED]
                bar.update(len(chunk))
        return self._scalars(RewardBatch.concat(rewards), lengths)

    def _scalars(self, rewards: RewardBatch, lengths: list[int]) -> dict[str, float]:
        n = self.samples
        solved = (rewards.column(self.solved_reward) >= SOLVED_AT).view(-1, n).sum(dim=1).tolist()
        out = {
            tags.eval_pass_at(1): sum(pass_at_k(n, c, 1) for c in solved) / len(solved),
            tags.eval_pass_at(n): sum(pass_at_k(n, c, n) for c in solved) / len(solved),
            tags.EVAL_REWARD_MEAN: float(rewards.total().mean()),
            **{tags.eval_reward(name): float(rewards.values[:, j].mean()) for j, name in enumerate(rewards.names)},
            tags.EVAL_RESPONSE_LENGTH_MEAN: sum(lengths) / max(len(lengths), 1),
            tags.EVAL_PROMPTS: float(len(solved)),
        }
        return out


def build_evaluator(
    cfg: Config, task: Task, formatter: PromptFormatter, sampler: Sampler, scorer: RewardScorer, *, progress: bool
) -> Evaluator:
    """The ``data.eval_*`` evaluation of ``task`` through ``sampler`` (training and ``moe-rl eval``)."""
    from moe_rl.experience.builders import sampling_params

    d = cfg.data
    sampling = sampling_params(cfg, formatter.tokenizer.eos_token_id, evaluation=True)
    return Evaluator(
        task.eval_problems(d.eval_max_prompts),
        formatter,
        sampler,
        scorer,
        sampling,
        d.eval_samples,
        d.eval_solved_reward,
        progress=progress,
    )
