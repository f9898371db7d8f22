"""Multi-turn rollouts (``rollout.multi_turn.generate_fn``): the calculator environment under a scripted
policy, failures that score 0, the loss over the policy's tokens only, the engine's
routing of every token (R3), the one-turn function equal to the single-turn rollout, and
training end to end on the local engine and an SGLang server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SUPPORT, WARM_START, demo_model_dir
from moe_rl.algorithms import policy_loss
from moe_rl.config import AlgorithmConfig, ConfigError, load_config
from moe_rl.data.tasks import ArithmeticChainTask, Problem
from moe_rl.data.tokenizer import demo_tokenizer
from moe_rl.environments import calculator
from moe_rl.rollout import multi_turn
from moe_rl.rollout.multi_turn import MultiTurnSampler, Transcript, TranscriptError
from moe_rl.rollout.single_turn import SingleTurnSampler
from moe_rl.rollout.types import RolloutEngine, RolloutError, Sample, SampleStatus, SamplingParams, Truncation
from moe_rl.experience.types import Experience
from moe_rl.trainer.batch import build_train_batch
from moe_rl.trainer.objective import UPDATE_REPORT, PolicyObjective
from moe_rl.trainer.packing import fixed_plan

import multi_turn_fns

TOKENIZER = demo_tokenizer()
PARAMS = SamplingParams(max_new_tokens=32, temperature=1.0, stop_token_ids=(TOKENIZER.eos_token_id,))


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedPolicy(RolloutEngine):
    """A scripted policy: turn k of every sample writes ``script[k]`` (cut after the first
    stop token, as an engine stops), log-prob -0.5 per token; routed experts hold each
    position's index, from ``routing_from`` on (what SGLang returns)."""

    def __init__(self, script: list[str], routed: bool = True) -> None:
        self.script, self.routed, self.requests = script, routed, []

    @property
    def weight_version(self) -> str:
        return "0"

    def generate(self, prompts, n, params, *, seed, return_routed_experts=False):
        raise NotImplementedError

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def turns(self, *, return_routed_experts: bool):
        yield _Source(self)

    async def generate_turn(self, token_ids, params, *, seed, routing_from=0) -> Sample:
        self.requests.append((list(token_ids), routing_from))
        out = ids(self.script[min(len(self.requests) - 1, len(self.script) - 1)])[: params.max_new_tokens]
        stop = next((i for i, t in enumerate(out) if t in params.stop_token_ids), None)
        out = out if stop is None else out[: stop + 1]
        end = len(token_ids) + len(out) - 1
        routed = (
            torch.arange(routing_from, end, dtype=torch.int32)[:, None, None].expand(-1, 1, 2).clone()
            if self.routed
            else None
        )
        return Sample(
            list(token_ids),
            out,
            [-0.5] * len(out),
            "stop" if stop is not None else "length",
            "0",
            seed,
            routed_experts=routed,
        )


class _Source:
    """The scripted policy as a TurnSource."""

    def __init__(self, policy: ScriptedPolicy) -> None:
        self.generate = policy.generate_turn


def sample_with(
    policy: ScriptedPolicy, fn, problem: Problem, *, timeout_s: float = 30.0, routed: bool = True, **kwargs
) -> Sample:
    sampler = MultiTurnSampler(policy, fn, TOKENIZER, kwargs=kwargs, timeout_s=timeout_s)
    return sampler.sample([problem], [ids(problem.prompt)], 1, PARAMS, seed=7, routed=routed)[0][0]


def text_of(sample: Sample, policy_only: bool | None = None) -> str:
    mask = sample.output_mask()
    return TOKENIZER.decode([t for t, m in zip(sample.output_ids, mask) if policy_only is None or m == policy_only])


def test_the_calculator_answers_a_scripted_policy_and_masks_its_own_tokens() -> None:
    policy = ScriptedPolicy(["calc(3*4)", "calc(12+5)", "\\boxed{17}<eos>"])
    s = sample_with(policy, calculator.generate, Problem("3*4+5=", "17"))
    assert text_of(s) == "calc(3*4)=12 calc(12+5)=17 \\boxed{17}<eos>"
    assert text_of(s, policy_only=True) == "calc(3*4)calc(12+5)\\boxed{17}<eos>"
    assert text_of(s, policy_only=False) == "=12 =17 "
    assert s.output_logprobs == [-0.5 if m else 0.0 for m in s.output_mask()]
    assert s.meta["turns"] == 3 and s.meta["tool_calls"] == 2 and s.meta["tool_failures"] == 0
    assert s.meta["policy_tokens"] + s.meta["environment_tokens"] == len(s.output_ids) and s.status is SampleStatus.OK
    # every turn continued the transcript, asking only for the routing of its new positions
    (first, _), (second, from2), (third, from3) = policy.requests
    assert second[: len(first)] == first and from2 == len(first) + len(ids("calc(3*4)")) - 1
    assert from3 == len(second) + len(ids("calc(12+5)")) - 1
    assert torch.equal(
        s.routed_experts[:, 0, 0], torch.arange(len(s.prompt_ids) + len(s.output_ids) - 1, dtype=torch.int32)
    )


def test_tool_errors_go_back_as_text_and_limits_truncate() -> None:
    for expression, why in (("1/0", "division by zero"), ("2**3", "unsupported Pow"), ("x", "unsupported Name")):
        with pytest.raises(calculator.ToolError, match=why):
            calculator.evaluate(expression)
    assert calculator.evaluate("7//2 + 7%2 - -1") == 5 and calculator.format_result(7 / 2) == "3.5"
    s = sample_with(
        ScriptedPolicy(["calc(3*+)", "calc(99999999*99999999)", "\\boxed{0}"]), calculator.generate, Problem("1=", "1")
    )
    assert text_of(s, policy_only=False) == "=error: not an expression =error: result too large "
    assert s.meta["tool_failures"] == 2 and s.meta["tool_calls"] == 2
    looping = sample_with(ScriptedPolicy(["calc(1+1)"]), calculator.generate, Problem("1=", "1"), max_turns=3)
    assert looping.meta["turns"] == 3 and looping.meta["tool_calls"] == 2 and looping.truncation is Truncation.TURNS
    assert looping.output_mask()[-1] == 1  # the last call's result is not appended: nothing follows it
    budget = sample_with(ScriptedPolicy(["calc(1+1)"]), calculator.generate, Problem("1=", "1"), max_output_tokens=14)
    assert budget.truncation is Truncation.TOKENS and len(budget.output_ids) <= 14


def test_a_failing_or_hanging_environment_scores_zero_and_the_rest_go_on() -> None:
    from moe_rl.rewards import RewardScorer, RewardSpec
    from moe_rl.experience.collector import generate_and_score, multi_turn_scalars
    from moe_rl.data.prompts import PromptFormatter

    policy = ScriptedPolicy(["\\boxed{2}<eos>"])
    sampler = MultiTurnSampler(policy, multi_turn_fns.sometimes_fails, TOKENIZER, kwargs={}, timeout_s=30)
    problems = [Problem("1+1=", "2"), Problem("1+2=", "3")]
    scorer = RewardScorer([RewardSpec("format", "format", 1.0, {})])
    sampled = generate_and_score(
        problems, PromptFormatter(TOKENIZER), sampler, scorer, PARAMS, 2, seed=1, return_routing=True
    )
    failed = [s.status is SampleStatus.FAILED for s in sampled.samples]
    assert failed == [False, False, True, True]
    assert sampled.rewards.values[:, 0].tolist() == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]  # the same response scores 1 when its environment worked
    for s in sampled.samples[2:]:  # what the failed turn sampled is kept as context, never trained on
        assert s.policy_token_count == 0 and s.output_ids == ids("\\boxed{2}<eos>") and "ConnectionError" in s.failure
        assert len(s.routed_experts) == len(s.prompt_ids) + len(s.output_ids) - 1
    assert multi_turn_scalars(sampled.samples)["rollout/multi_turn/failed_samples"] == 2
    hung = sample_with(ScriptedPolicy(["x"]), multi_turn_fns.hangs, Problem("1=", "1"), timeout_s=0.2)
    assert (
        hung.failure == "TimeoutError"
        and hung.output_ids == []
        and len(hung.routed_experts) == len(hung.prompt_ids) - 1
    )


class BlockingPolicy(ScriptedPolicy):
    """A scripted policy whose every turn blocks the event loop for ``seconds`` (the engine's
    share, never the generate function's)."""

    def __init__(self, script: list[str], seconds: float) -> None:
        super().__init__(script)
        self.seconds = seconds

    async def generate_turn(self, token_ids, params, *, seed, routing_from=0) -> Sample:
        time.sleep(self.seconds)
        return await super().generate_turn(token_ids, params, seed=seed, routing_from=routing_from)


def test_a_function_blocking_the_event_loop_is_named_and_its_late_sample_scores_zero(monkeypatch, caplog) -> None:
    monkeypatch.setattr(multi_turn, "BLOCKING_WARN_S", 0.1)
    with caplog.at_level("WARNING", logger="moe_rl.rollout.multi_turn"):
        s = sample_with(ScriptedPolicy(["1<eos>"]), multi_turn_fns.blocks, Problem("1=", "1"), timeout_s=0.15)
    assert s.failure.startswith("TimeoutError: ran 0.2 s outside engine turns, past rollout.multi_turn.timeout_s=0.15")
    assert "rollout.multi_turn.generate_fn=multi_turn_fns:blocks held the event loop for 0.2" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="moe_rl.rollout.multi_turn"):  # the engine's own blocking is not its
        s = sample_with(BlockingPolicy(["1<eos>"], 0.2), multi_turn_fns.blocks, Problem("1=", "1"), seconds=0.0)
    assert s.status is SampleStatus.OK and caplog.text == ""


class SlowPolicy(ScriptedPolicy):
    """A scripted policy whose every turn takes ``seconds`` in the engine (awaited, as a
    server's reply or a queue for a server slot)."""

    def __init__(self, script: list[str], seconds: float) -> None:
        super().__init__(script)
        self.seconds = seconds

    async def generate_turn(self, token_ids, params, *, seed, routing_from=0) -> Sample:
        await asyncio.sleep(self.seconds)
        return await super().generate_turn(token_ids, params, seed=seed, routing_from=routing_from)


def test_the_timeout_counts_only_time_outside_the_engines_turns() -> None:
    """Three turns of 0.3 s each in the engine, a calculator taking ~0: within a 0.2 s limit
    (it counts the function's and its environment's time, not the engine's); a function
    that hangs outside the engine still times out."""
    policy = SlowPolicy(["calc(3*4)", "calc(12+5)", "\\boxed{17}<eos>"], 0.3)
    s = sample_with(policy, calculator.generate, Problem("3*4+5=", "17"), timeout_s=0.2)
    assert s.status is SampleStatus.OK and s.meta["turns"] == 3, s.failure
    assert s.meta["environment_seconds"] < 0.2
    both = sample_with(SlowPolicy(["1<eos>"], 0.3), multi_turn_fns.best_of_two, Problem("1=", "1"), timeout_s=0.2)
    assert both.status is SampleStatus.OK and both.meta["environment_seconds"] < 0.2, both.failure  # turns at once
    start = time.perf_counter()
    hung = sample_with(SlowPolicy(["x"], 0.3), multi_turn_fns.hangs, Problem("1=", "1"), timeout_s=0.2)
    assert hung.failure == "TimeoutError" and time.perf_counter() - start < 2.0


def test_a_tool_call_that_never_returns_is_left_on_a_daemon_thread(caplog) -> None:
    """The sample times out; the tool's thread (asyncio.to_thread) is a daemon, so the
    process can still exit when the run ends (a thread pool's would be joined), and a
    warning says a call was left behind."""
    import threading

    with caplog.at_level("WARNING", logger="moe_rl.rollout.multi_turn"):
        s = sample_with(ScriptedPolicy(["x"]), multi_turn_fns.tool_never_returns, Problem("1=", "1"), timeout_s=0.2)
    assert s.failure == "TimeoutError"
    left = [t for t in threading.enumerate() if t.name == "moe-rl-to-thread"]
    assert left and all(t.daemon for t in left)
    assert "1 blocking call(s) of the rollout (asyncio.to_thread) still running" in caplog.text


def test_the_rollouts_blocking_calls_share_at_most_its_workers_daemon_threads() -> None:
    import concurrent.futures
    import threading

    from moe_rl.rollout.multi_turn import DaemonThreads

    def ours() -> int:
        return sum(t.name == "moe-rl-to-thread" for t in threading.enumerate())

    before = ours()
    threads = DaemonThreads(4)
    seen: list[int] = []
    calls = [threads.submit(lambda: (time.sleep(0.01), seen.append(ours()))[1]) for _ in range(40)]
    concurrent.futures.wait(calls, timeout=30)
    assert all(c.done() and c.exception() is None for c in calls) and len(seen) == 40
    assert max(seen) - before <= 4


def test_a_function_ignoring_its_cancellation_is_abandoned(monkeypatch, caplog) -> None:
    monkeypatch.setattr(multi_turn, "CANCEL_GRACE_S", 0.1)
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="moe_rl.rollout.multi_turn"):
        s = sample_with(ScriptedPolicy(["x"]), multi_turn_fns.ignores_cancellation, Problem("1=", "1"), timeout_s=0.1)
    assert time.perf_counter() - start < 2.0  # the timeout, the grace, the loop's own grace at its end
    assert s.failure == "TimeoutError: ignored its cancellation: abandoned"
    assert "multi_turn_fns:ignores_cancellation ignored its cancellation" in caplog.text


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (multi_turn_fns.skips_a_token, "TranscriptError: a policy turn must continue the transcript"),
        (multi_turn_fns.returns_none, "TranscriptError: the generate function returned NoneType, not a Transcript"),
        (multi_turn_fns.returns_dict, "TranscriptError: the generate function returned dict, not a Transcript"),
        (multi_turn_fns.no_policy_turn, "TranscriptError: the transcript has no policy turn"),
        (multi_turn_fns.nan_logprobs, "TranscriptError: a policy turn's log-probs are not finite"),
        (multi_turn_fns.one_logprob_too_many, "TranscriptError: a policy turn has 1 tokens and 2 log-probs"),
        (multi_turn_fns.raises_cancelled, "FunctionCancelled: the generate function raised CancelledError"),
        # a budget of 0 tokens is not "the default" (rollout.max_new_tokens, a whole turn more)
        (multi_turn_fns.spends_its_budget, "TranscriptError: asked for a turn of max_new_tokens=0"),
    ],
)
def test_a_broken_function_or_transcript_is_a_failed_sample(fn, why: str) -> None:
    """Each scores 0 with its reason; what it saw is kept as context (routing included)."""
    s = sample_with(ScriptedPolicy(["ab"]), fn, Problem("1+1=", "2"))
    assert s.failure.startswith(why) and s.policy_token_count == 0 and s.weight_version == "0"
    assert len(s.routed_experts) == len(s.prompt_ids) + len(s.output_ids) - 1


def test_a_samples_status_and_the_metadata_its_rewards_see() -> None:
    """ok, truncated (the function's limit or the model's context), failed; the rewards see
    the typed fields under the keys they always had in ``RewardInput.metadata``."""
    t = Transcript(ids("1="), response_text="2", meta={"tool_calls": 1})
    t.add_policy(_turn(t, "ab", [-1.0, -1.0]))
    t.add_environment(ids("xy"))
    ok = t.to_sample(0)
    assert ok.status is SampleStatus.OK and ok.truncation is None and ok.failure is None
    assert ok.meta == {"tool_calls": 1} and ok.response_text == "2" and ok.dropped_environment_tokens == 2
    assert ok.reward_metadata() == {"tool_calls": 1, "response_text": "2", "dropped_environment_tokens": 2}
    t.meta["truncated"] = "turns"
    by_turns = t.to_sample(0)
    assert by_turns.status is SampleStatus.TRUNCATED and by_turns.truncation is Truncation.TURNS
    assert by_turns.reward_metadata()["truncated"] == "turns"
    cut = t.to_sample(0, max_tokens=3)
    assert cut.truncation is Truncation.CONTEXT and cut.reward_metadata()["truncated"] == "context"
    assert pickle.loads(pickle.dumps(cut)) == cut
    t.meta["truncated"] = "budget"  # no limit moe-rl knows: the rewards see it, the metrics do not count it
    other = t.to_sample(0)
    assert other.status is SampleStatus.OK and other.reward_metadata()["truncated"] == "budget"
    failed = sample_with(ScriptedPolicy(["ab"]), multi_turn_fns.returns_none, Problem("1=", "1"))
    assert failed.status is SampleStatus.FAILED and failed.truncation is None
    assert set(failed.meta) == {"turns", "policy_tokens", "environment_tokens", "environment_seconds"}
    assert failed.reward_metadata() == {"failed": failed.failure, **failed.meta}
    single = Sample([1], [2], [-0.5], "length", "0", 0)
    assert single.status is SampleStatus.OK and single.reward_metadata() == {}


def test_a_keyboard_interrupt_in_a_rollout_says_where_it_came_from() -> None:
    with pytest.raises(
        KeyboardInterrupt, match="interrupted during the rollout .*multi_turn_fns:raises_keyboard_interrupt"
    ):
        sample_with(ScriptedPolicy(["ab"]), multi_turn_fns.raises_keyboard_interrupt, Problem("1=", "1"))


def test_turns_stop_at_the_models_context_and_longer_transcripts_are_cut() -> None:
    """A turn samples at most up to the context, one asked for at it gets no tokens (again:
    the sample fails); a transcript built past it is cut there, routing with it."""
    policy = ScriptedPolicy(["ab", "c" * 40])
    sampler = MultiTurnSampler(
        policy, multi_turn_fns.overlong, TOKENIZER, kwargs={"inserted": 8}, timeout_s=30, max_tokens=30
    )
    s = sampler.sample([Problem("1=", "1")], [ids("1=")], 1, PARAMS, seed=7, routed=True)[0][0]
    assert s.status is SampleStatus.TRUNCATED and s.truncation is Truncation.CONTEXT and s.finish_reason == "length"
    assert len(s.prompt_ids) + len(s.output_ids) == 30 and s.meta["turns"] == 2  # the third turn: no tokens
    assert policy.requests[1][0] == s.prompt_ids + s.output_ids[: 2 + 16] and len(policy.requests) == 2
    assert len(s.routed_experts) == 29
    t = Transcript(ids("1="))
    t.add_policy(_turn(t, "ab", [-1.0, -1.0]))
    t.add_environment(ids("xyz"))
    t.add_policy(_turn(t, "cd", [-1.0, -1.0]))
    t.routed_experts = torch.zeros(len(t.token_ids) - 1, 1, 2)
    cut = t.to_sample(0, max_tokens=len(ids("1=abxyzc")))
    assert cut.output_ids == ids("abxyzc") and cut.loss_mask == [1, 1, 0, 0, 0, 1] and len(cut.routed_experts) == 7
    assert cut.truncation is Truncation.CONTEXT and cut.finish_reason == "length"
    with pytest.raises(TranscriptError, match="no policy token of the transcript lies within the model's 2 tokens"):
        t.to_sample(0, max_tokens=2)


def test_a_step_whose_samples_all_failed_stops_the_run_in_one_line() -> None:
    collector = scripted_collector("fails_after_a_turn")
    with pytest.raises(RolloutError) as stopped:
        collector.collect(0)
    assert str(stopped.value) == (
        "step 1: 8 of 8 samples failed in rollout.multi_turn.generate_fn=multi_turn_fns:fails_after_a_turn"
        " (rollout.multi_turn.max_failed_frac=1); the first: ConnectionError: the environment went away"
    )
    some = scripted_collector("fails_by_seed", "rollout.multi_turn.max_failed_frac=0.25")
    with pytest.raises(RolloutError, match=r"step 1: \d of 8 samples failed .*max_failed_frac=0.25"):
        some.collect(0)


@pytest.mark.parametrize("mode", ["zero", "drop"])
def test_failed_samples_enter_their_groups_advantages_as_zero_or_not_at_all(mode: str) -> None:
    from moe_rl.algorithms import compute_advantages

    exp, scalars = scripted_collector("fails_by_seed", f"rollout.multi_turn.failed_samples={mode}").collect(0)
    failed = torch.tensor([s.status is SampleStatus.FAILED for s in exp.samples])
    assert 0 < int(failed.sum()) < 8 and scalars["rollout/multi_turn/failed_samples"] == int(failed.sum())
    assert exp.rewards[failed].sum() == 0 and (exp.rewards[~failed] == 1).all()
    ok = [s for s in exp.samples if s.status is not SampleStatus.FAILED]  # response/* leaves the failed ones out
    assert scalars["response/length_mean"] == pytest.approx(sum(s.policy_token_count for s in ok) / len(ok))
    for g in range(2):
        rows = slice(4 * g, 4 * g + 4)
        if mode == "zero":
            expected = compute_advantages("grpo", exp.rewards[rows], 4)
        else:  # the group is its samples that did not fail
            expected = torch.zeros(4)
            kept = (~failed[rows]).nonzero().flatten()
            if len(kept):
                expected[kept] = compute_advantages("grpo", exp.rewards[rows][kept], len(kept))
        torch.testing.assert_close(exp.advantages[rows], expected)


def test_drop_takes_each_groups_statistics_over_its_samples_that_did_not_fail() -> None:
    from moe_rl.algorithms import compute_advantages

    values = torch.tensor([[1.0, 0.5], [0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.2], [0.5, 1.0]])
    valid = [True, False, True, True, True, False]  # one failed per group of 3: groups of 2 remain
    kept = [0, 2, 3, 4]
    for name in ("grpo", "dr_grpo", "rloo", "gdpo"):
        drop = compute_advantages(name, values, 3, weights=[1.0, 0.5], valid=valid)
        torch.testing.assert_close(drop[kept], compute_advantages(name, values[kept], 2, weights=[1.0, 0.5]))
        assert drop[[1, 5]].tolist() == [0.0, 0.0]
        every = compute_advantages(name, values, 3, weights=[1.0, 0.5], valid=[True] * 6)
        assert torch.equal(every, compute_advantages(name, values, 3, weights=[1.0, 0.5]))
    uneven = compute_advantages("grpo", values, 3, weights=[1.0, 0.0], valid=[True, False, True, True, True, True])
    torch.testing.assert_close(uneven[3:], compute_advantages("grpo", values[3:, :1], 3))
    torch.testing.assert_close(uneven[[0, 2]], compute_advantages("grpo", values[[0, 2], :1], 2))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rollout.multi_turn.failed_samples=skip",
            "rollout.multi_turn.failed_samples='skip' is not valid; valid: zero, drop",
        ),
        ("rollout.multi_turn.max_failed_frac=1.5", "rollout.multi_turn.max_failed_frac=1.5 must be in \\[0, 1\\]"),
        ("rollout.multi_turn.max_failed_frac=-0.1", "rollout.multi_turn.max_failed_frac=-0.1 must be in"),
    ],
)
def test_the_failed_sample_options_are_checked_at_load(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def scripted_collector(fn: str, *overrides: str):
    """The collector of a run of ``multi_turn_fns:<fn>`` on the scripted policy (2 prompts x 4)."""
    from moe_rl.data.prompts import PromptFormatter
    from moe_rl.experience.builders import build_sampler, sampling_params
    from moe_rl.experience.collector import ExperienceCollector
    from moe_rl.rewards import RewardScorer, RewardSpec

    cfg = load_config(
        None,
        [
            f"rollout.multi_turn.generate_fn=multi_turn_fns:{fn}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            *overrides,
        ],
    )
    policy = ScriptedPolicy(["\\boxed{2}<eos>"])
    return ExperienceCollector(
        rollout=cfg.rollout,
        advantage=cfg.algorithm.advantage,
        seed=cfg.train.seed,
        task=ArithmeticChainTask(9),
        formatter=PromptFormatter(TOKENIZER),
        engine=policy,
        sampler=build_sampler(cfg.rollout.multi_turn, policy, TOKENIZER, 64),
        scorer=RewardScorer([RewardSpec("format", "format", 1.0, {})]),
        sampling=sampling_params(cfg, TOKENIZER.eos_token_id),
        return_routing=True,
    )


def test_metrics_and_logs_survive_odd_meta_and_nan_and_show_transcripts(tmp_path, caplog) -> None:
    """A string or NaN where the metrics read numbers counts 0 (one warning); NaN in a
    histogram is left out; samples.jsonl and TensorBoard's text mark each turn's role."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moe_rl.experience.collector import multi_turn_scalars
    from moe_rl.experience.sample_log import sample_records
    from moe_rl.trainer.metrics import StepLogger

    with caplog.at_level("WARNING", logger="moe_rl.train"):
        s = sample_with(ScriptedPolicy(["ab"]), multi_turn_fns.odd_meta, Problem("1=", "1"))
        scalars = multi_turn_scalars([s, s])
    assert scalars["rollout/multi_turn/tool_calls_mean"] == 0 and scalars["rollout/multi_turn/tool_failures"] == 0
    assert "meta['tool_calls']='three' is not a finite number" in caplog.text
    exp = multi_turn_experience()
    exp.samples[2].failure = "ConnectionError: gone"
    records = sample_records(exp, TOKENIZER, 1, 3, 1)
    assert records[0].turns == [
        {"role": "policy", "text": "calc("},
        {"role": "environment", "text": "=3 "},
        {"role": "policy", "text": "3<eos>"},
    ]
    assert records[2].failed == "ConnectionError: gone" and records[2].turns is None
    logger = StepLogger(tmp_path, 1, 0, enabled=True, progress=False)
    logger.log(1, {"x": 1.0}, {}, {"train/log_ratio": torch.tensor([float("nan"), 0.5])}, records)
    logger.log(2, {"x": 1.0}, {}, {"train/log_ratio": torch.tensor([float("nan")])})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert (
        lines[0]["turns"][1] == {"role": "environment", "text": "=3 "} and lines[2]["failed"] == "ConnectionError: gone"
    )
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "histograms": 0}).Reload()
    text = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "**policy 1:** calc(<br>**environment:** =3 <br>**policy 2:** 3&lt;eos&gt;" in text
    assert "**failed (not trained):** ConnectionError: gone" in text
    assert [e.step for e in events.Histograms("train/log_ratio")] == [1]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("multi_turn_fns:not_async", "must be an async function"),
        ("multi_turn_fns:too_few_args", "must take \\(problem, \\*, prompt_ids, engine"),
        ("multi_turn_fns:missing", "cannot be imported"),
        ("multi_turn_fns", "must be 'package.module:function'"),
    ],
)
def test_a_generate_function_is_checked_when_the_config_loads(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"rollout.multi_turn.generate_fn={spec}"])
    with pytest.raises(ConfigError, match="not set"):
        load_config(None, ["rollout.multi_turn.generate_kwargs.max_turns=3"])
    cfg = load_config(
        None,
        [
            "rollout.multi_turn.generate_fn=moe_rl.environments.calculator:generate",
            "rollout.multi_turn.generate_kwargs.max_turns=3",
        ],
    )
    assert cfg.rollout.multi_turn.generate_kwargs == {"max_turns": 3}
    overlong = [
        "rollout.multi_turn.generate_fn=moe_rl.environments.calculator:generate",
        "reward.rewards=[{name: o, fn: overlong_penalty}]",
        "reward.conditionals=[]",
    ]
    with pytest.raises(ConfigError, match=r"reward.rewards\[0\] \(overlong_penalty\) needs kwargs.max_tokens"):
        load_config(None, overlong)
    load_config(None, [*overlong[::2], "reward.rewards=[{name: o, fn: overlong_penalty, kwargs: {max_tokens: 64}}]"])
    shipped = load_config(str(ROOT / "configs" / "multi_turn" / "calculator.yaml"), [])
    assert (
        shipped.rollout.multi_turn.generate_fn == "moe_rl.environments.calculator:generate"
        and shipped.data.task == "arithmetic_chain"
    )
    with pytest.raises(ConfigError, match="max_turnz"):
        load_config(
            None,
            [
                "rollout.multi_turn.generate_fn=moe_rl.environments.calculator:generate",
                "rollout.multi_turn.generate_kwargs.max_turnz=3",
            ],
        )


def multi_turn_experience() -> Experience:
    """Two transcripts: policy / environment / policy tokens, and a failed one (all context)."""
    a = Transcript(ids("1+2="))
    a.add_policy(_turn(a, "calc(", [-0.3, -0.2, -0.1, -0.4, -0.5]))
    a.add_environment(ids("=3 "))
    a.add_policy(_turn(a, "3<eos>", [-0.6, -0.7]))
    b = Transcript(ids("4+4="))
    b.add_policy(_turn(b, "8", [-0.9]))
    samples = [
        a.to_sample(0),
        b.to_sample(1),
        Sample(ids("5="), ids("xy"), [0.0, 0.0], "abort", "0", 2, loss_mask=[0, 0]),
    ]
    return Experience(samples, torch.zeros(3, 1), ["r"], torch.tensor([1.0, -0.5, 2.0]))


def _turn(t: Transcript, text: str, logprobs: list[float]):
    from moe_rl.rollout.multi_turn import Turn

    return Turn(t.token_ids, ids(text), logprobs, "stop", "0")


def test_the_loss_counts_the_policys_tokens_only() -> None:
    """GRPO's loss and counts from multi-turn samples equal a hand computation that walks
    each transcript's tokens and skips what the environment inserted."""
    exp = multi_turn_experience()
    assert exp.num_response_tokens == 5 + 2 + 1 and exp.num_responses == 2
    batch = build_train_batch(
        exp,
        0,
        fixed_plan([0, 1, 2], 3, 3),
        seq_len_multiple=1,
        pad_id=0,
        device=torch.device("cpu"),
        with_routing=False,
    )
    mb = batch.micro_batches[0]
    logp = -torch.rand(mb.mask.shape, generator=torch.Generator().manual_seed(0))
    old = logp - 0.3 * torch.rand(mb.mask.shape, generator=torch.Generator().manual_seed(1))
    mb.old_logp = old
    loss, outputs = PolicyObjective(AlgorithmConfig(loss="grpo"), batch.num_tokens, batch.num_seqs)(
        torch.stack([logp, torch.zeros_like(logp)], -1), mb
    )
    metrics = outputs[UPDATE_REPORT].metrics
    hand, count = 0.0, 0
    for row, s in enumerate(exp.samples):
        for k, (_token, policy) in enumerate(zip(s.output_ids, s.output_mask())):
            position = len(s.prompt_ids) - 1 + k  # the log-prob of output token k
            if policy:
                ratio = float((logp[row, position] - old[row, position]).exp())
                a = float(exp.advantages[row])
                hand += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
                count += 1
                assert float(mb.rollout_logp[row, position]) == pytest.approx(s.output_logprobs[k])
            else:
                assert float(mb.mask[row, position]) == 0 and float(mb.rollout_logp[row, position]) == 0
    assert count == batch.num_tokens == 8 and float(metrics["tokens"]) == 8
    assert float(loss) == pytest.approx(hand / count, rel=1e-5)
    ref, _ = policy_loss(
        "grpo", logp, old, mb.advantages, mb.mask, num_tokens=batch.num_tokens, num_seqs=batch.num_seqs
    )
    torch.testing.assert_close(loss, ref)
    # the environment's tokens as input positions (routing metrics report them apart)
    env = mb.environment_tokens[0]
    p = len(exp.samples[0].prompt_ids)
    assert env.nonzero().flatten().tolist() == list(range(p + 5, p + 5 + len(ids("=3 "))))
    assert float(mb.environment_tokens[2].sum()) == 2 and float(mb.environment_tokens[1].sum()) == 0


def test_the_first_error_of_a_generate_function_is_logged_with_its_traceback(caplog) -> None:
    policy = ScriptedPolicy(["calc(3*4)"])
    with caplog.at_level("WARNING", logger="moe_rl.rollout.multi_turn"):
        s = sample_with(policy, multi_turn_fns.fails_after_a_turn, Problem("1=", "1"))
    assert "ConnectionError" in s.failure
    (record,) = [r for r in caplog.records if r.exc_info]
    assert record.getMessage() == "a sample failed in rollout.multi_turn.generate_fn=multi_turn_fns:fails_after_a_turn"
    assert "fails_after_a_turn" in caplog.text.split("Traceback", 1)[1]  # the function's own frame


def test_a_failed_sample_whose_prompt_fills_the_context_sends_no_routing_probe() -> None:
    """A function failing before its first turn gets its prompt's routing from a one-token
    request, unless the prompt already fills the model's context (the engine would refuse
    that request and stop the run): then it has none."""
    for context, probes in ((len(ids("1=")) + 4, 1), (len(ids("1=")), 0)):
        policy = ScriptedPolicy(["x"])
        sampler = MultiTurnSampler(
            policy, multi_turn_fns.returns_none, TOKENIZER, kwargs={}, timeout_s=30, max_tokens=context
        )
        s = sampler.sample([Problem("1=", "1")], [ids("1=")], 1, PARAMS, seed=7, routed=True)[0][0]
        assert s.status is SampleStatus.FAILED and len(policy.requests) == probes
        assert (s.routed_experts is None) == (probes == 0)


def test_a_last_turn_cut_after_sampling_keeps_the_routing_of_what_is_left() -> None:
    """An edited turn (tokens and log-probs cut) keeps the routing the engine returned for
    all it sampled: the sample's routing is cut to the transcript (routing is causal); too
    little routing is still an error."""
    from moe_rl.rollout.multi_turn import Turn

    t = Transcript(ids("1="))
    sampled = ids("abcd")
    routing = torch.arange(len(ids("1=")) + len(sampled) - 1)[:, None, None].expand(-1, 1, 2).clone()
    t.add_policy(Turn(t.token_ids, sampled[:2], [-1.0, -1.0], "stop", "0", routing))
    s = t.to_sample(0)
    assert s.output_ids == sampled[:2] and torch.equal(s.routed_experts, routing[: len(t.token_ids) - 1])
    t.routed_experts = routing[:1]
    with pytest.raises(TranscriptError, match="routing covers 1 positions"):
        t.to_sample(0)


def test_trailing_environment_tokens_are_left_out() -> None:
    t = Transcript(ids("1="))
    t.add_policy(_turn(t, "ab", [-1.0, -1.0]))
    t.add_environment(ids(" done"))
    s = t.to_sample(0)
    assert s.output_ids == ids("ab") and s.loss_mask == [1, 1]


# ------------------------------------------------------------------ on the built-in model


@pytest.fixture(scope="module")
def local_engine(demo_cache):
    from moe_rl.rollout.local import LocalEngine

    return LocalEngine(demo_model_dir(demo_cache))


def test_one_turn_equals_the_single_turn_rollout(local_engine) -> None:
    """A function that makes one engine call gets the samples the default rollout gets:
    tokens, log-probs and routed experts (the local engine batches the concurrent turns)."""
    tokenizer = TOKENIZER
    problems = ArithmeticChainTask(9).problems(0, 0, 3)
    prompts = [ids(p.prompt) for p in problems]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    single = SingleTurnSampler(local_engine).sample(problems, prompts, 4, params, seed=11, routed=True)
    multi = MultiTurnSampler(local_engine, multi_turn_fns.one_turn, tokenizer, kwargs={}, timeout_s=60)
    turned = multi.sample(problems, prompts, 4, params, seed=11, routed=True)
    for a, b in zip((s for g in single for s in g), (s for g in turned for s in g)):
        assert (a.output_ids, a.seed, a.finish_reason) == (b.output_ids, b.seed, b.finish_reason)
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-6)
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert b.loss_mask == [1] * len(b.output_ids) and b.meta["turns"] == 1


def test_a_token_id_the_local_engine_refuses_stops_the_run_as_sglangs_refusal_does(local_engine) -> None:
    """A token id outside the vocabulary, inserted by an environment: the run stops naming
    it, as SGLang's HTTP 400 stops it (it was every sample of the batch failing with it)."""
    problems = ArithmeticChainTask(9).problems(0, 0, 2)
    prompts = [ids(p.prompt) for p in problems]
    vocab = local_engine.model.config.vocab_size
    multi = MultiTurnSampler(
        local_engine, multi_turn_fns.inserts_token, TOKENIZER, kwargs={"token": vocab + 5}, timeout_s=60
    )
    with pytest.raises(RolloutError, match=rf"refused token ids outside \[0, {vocab}\): \[{vocab + 5}\]"):
        multi.sample(problems, prompts, 2, PARAMS, seed=3, routed=False)
    fine = MultiTurnSampler(local_engine, multi_turn_fns.inserts_token, TOKENIZER, kwargs={"token": 4}, timeout_s=60)
    assert all(
        s.status is SampleStatus.OK for g in fine.sample(problems, prompts, 2, PARAMS, seed=3, routed=False) for s in g
    )


def test_multi_turn_routing_is_the_engines_for_every_token(local_engine) -> None:
    """The routing a two-turn sample carries (the second turn's prefill of the first turn's
    and the environment's tokens) equals the engine's router on the whole sequence."""
    from moe_rl.routing.hf_routing import transformers_routing

    problems = ArithmeticChainTask(9).problems(1, 0, 2)
    prompts = [ids(p.prompt) for p in problems]
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    multi = MultiTurnSampler(local_engine, multi_turn_fns.two_turns, TOKENIZER, kwargs={}, timeout_s=60)
    samples = [s for g in multi.sample(problems, prompts, 4, params, seed=5, routed=True) for s in g]
    two = [s for s in samples if s.meta["turns"] == 2]
    assert two and all(s.loss_mask[: 3 + len(ids(" ok "))] == [1] * 3 + [0] * len(ids(" ok ")) for s in two)
    for s in samples:
        sequence = torch.tensor([s.prompt_ids + s.output_ids])
        experts, _ = transformers_routing(local_engine.model, sequence[:, :-1])
        assert torch.equal(s.routed_experts.long(), experts[0].long())


def train(cache: str, run_dir: Path, *overrides: str) -> dict[int, dict]:
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
    }
    args = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        *WARM_START,
        f"warm_start.cache_dir={cache}",
        f"train.run_dir={run_dir}",
        "train.progress=false",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        *overrides,
    ]
    with open(run_dir.with_suffix(".log"), "w") as log:
        rc = subprocess.run(args, stdout=log, stderr=log, timeout=400, env=env).returncode
    assert rc == 0, run_dir.with_suffix(".log").read_text()[-3000:]
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def assert_multi_turn_r3(rows: dict[int, dict]) -> None:
    for row in rows.values():
        assert row["rollout/multi_turn/turns_mean"] > 1 and row["rollout/multi_turn/environment_tokens_mean"] > 0
        assert row["routing/train_vs_rollout/changed_frac/mean"] == 0  # R3: every token routed as the engine did
        assert row["routing/train_vs_rollout/environment_tokens/changed_frac/mean"] == 0
        assert row["routing/train_vs_rollout/logp_mismatch/mean"] < 1e-3
        assert abs(row["train/loss"]) < 10


@pytest.mark.e2e
def test_a_run_whose_every_sample_fails_stops_in_one_line(demo_cache, tmp_path) -> None:
    from conftest import moe_rl

    done = moe_rl(
        "train",
        *WARM_START,
        f"warm_start.cache_dir={demo_cache}",
        f"train.run_dir={tmp_path / 'run'}",
        "train.progress=false",
        "train.steps=3",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.multi_turn.generate_fn=multi_turn_fns:returns_none",
        env={"PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "moe-rl: stopped: step 1: 4 of 4 samples failed in rollout.multi_turn.generate_fn=multi_turn_fns:returns_none"
        " (rollout.multi_turn.max_failed_frac=1); the first: TranscriptError: the generate function returned NoneType, not a Transcript"
    )


@pytest.mark.e2e
def test_multi_turn_r3_training_on_the_local_engine(demo_cache, tmp_path) -> None:
    rows = train(
        demo_cache,
        tmp_path / "local",
        "train.steps=2",
        "routing.replay=r3",
        "rollout.multi_turn.generate_fn=multi_turn_fns:two_turns",
        "rollout.max_new_tokens=4",
    )
    assert_multi_turn_r3(rows)


@pytest.mark.e2e
def test_multi_turn_r3_training_against_an_sglang_server(demo_cache, stand_in_sglang, tmp_path) -> None:
    from conftest import demo_weights_on

    url = demo_weights_on(stand_in_sglang, demo_cache)
    rows = train(
        demo_cache,
        tmp_path / "sglang",
        "train.steps=2",
        "routing.replay=r3",
        "rollout.multi_turn.generate_fn=multi_turn_fns:two_turns",
        "rollout.max_new_tokens=4",
        "rollout.engine=sglang",
        f"rollout.server.urls=[{url}]",
        "rollout.weight_sync.method=disk",
    )
    assert_multi_turn_r3(rows)
