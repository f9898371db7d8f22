"""Rewards scored as groups finish (``reward.score_as_finished``): the same rewards as
scoring after the whole batch, single- and multi-turn (with failed samples), and each
group handed over exactly once. (The scorer's side: test_rewards.py; a group scored while
a later one still generates, against the SGLang stand-in: tests/server/test_rollout.py.)"""

from __future__ import annotations

import pytest
import torch

from conftest import demo_model_dir
from moe_rl.config import load_config
from moe_rl.data.prompts import PromptFormatter
from moe_rl.data.tasks import ArithmeticChainTask, Problem
from moe_rl.experience.builders import build_scorer
from moe_rl.experience.collector import generate_and_score
from moe_rl.rewards import RewardScorer, RewardSpec
from moe_rl.rollout.multi_turn import MultiTurnSampler
from moe_rl.rollout.single_turn import SingleTurnSampler
from moe_rl.rollout.types import Sample, SamplingParams

import multi_turn_fns
from test_multi_turn import PARAMS, TOKENIZER, ScriptedPolicy, ids


@pytest.fixture(scope="module")
def local_engine(demo_cache):
    from moe_rl.rollout.local import LocalEngine

    return LocalEngine(demo_model_dir(demo_cache))


def test_scoring_groups_as_they_finish_equals_scoring_at_the_end() -> None:
    """Multi-turn samples, half of them failed: each group handed to the scorer as its last
    transcript ends gets the rewards scoring after the whole batch gives (failed ones 0)."""
    problems = [Problem("1+1=", "2"), Problem("1+2=", "3"), Problem("2+2=", "4")]
    specs = [RewardSpec("format", "format", 1.0, {}), RewardSpec("correct", "math_correct", 1.0, {})]

    def scored(as_finished: bool):
        sampler = MultiTurnSampler(
            ScriptedPolicy(["\\boxed{2}<eos>"]), multi_turn_fns.sometimes_fails, TOKENIZER, kwargs={}, timeout_s=30
        )
        scorer = RewardScorer(specs, score_as_finished=as_finished)
        sampled = generate_and_score(problems, PromptFormatter(TOKENIZER), sampler, scorer, PARAMS, 2, seed=1)
        scorer.close()
        return sampled

    at_end, as_finished = scored(False), scored(True)
    assert torch.equal(as_finished.rewards.values, at_end.rewards.values)
    assert as_finished.rewards.failures == at_end.rewards.failures
    assert [s.output_ids for s in as_finished.samples] == [s.output_ids for s in at_end.samples]
    assert as_finished.rewards.values[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # the failed group scores 0
    assert as_finished.rewards.values[:, 1].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_the_local_engine_hands_each_group_over_once_and_scores_as_at_the_end(local_engine) -> None:
    """Each group reaches ``on_group`` exactly once, before ``sample`` returns, with the
    samples it returns; rewards scored as groups finish equal those scored at the end."""

    problems = ArithmeticChainTask(9).problems(0, 0, 4)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(TOKENIZER.eos_token_id,))
    seen: list[tuple[int, list[Sample]]] = []
    groups = SingleTurnSampler(local_engine).sample(
        problems,
        [ids(p.prompt) for p in problems],
        3,
        params,
        seed=3,
        routed=False,
        on_group=lambda i, g: seen.append((i, g)),
    )
    assert sorted(i for i, _ in seen) == list(range(len(problems)))
    assert all(a is b for i, group in seen for a, b in zip(group, groups[i], strict=True))

    def scored(as_finished: bool):
        cfg = load_config(overrides=[f"reward.score_as_finished={str(as_finished).lower()}"])
        scorer = build_scorer(cfg)
        sampled = generate_and_score(
            problems, PromptFormatter(TOKENIZER), SingleTurnSampler(local_engine), scorer, params, 3, seed=3
        )
        scorer.close()
        return sampled

    at_end, as_finished = scored(False), scored(True)
    assert (
        torch.equal(as_finished.rewards.values, at_end.rewards.values)
        and at_end.rewards.names == as_finished.rewards.names
    )
    assert [s.output_ids for s in as_finished.samples] == [s.output_ids for s in at_end.samples]
