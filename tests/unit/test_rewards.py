"""Rule rewards and the safe multi-reward scorer."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from moe_rl.rewards import scorer as scorer_module
from moe_rl.rewards import ConditionalSpec, RewardInput, RewardScorer, RewardSpec, resolve_reward_fn
from moe_rl.rewards.rules import format_reward, length_reward, math_correct, overlong_penalty


def sample(response: str, answer: str | None = None, n: int | None = None) -> RewardInput:
    return RewardInput(prompt="q", response=response, answer=answer, num_response_tokens=n)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so the answer is \\boxed{1/2}", "0.5", 1.0),
        ("the result: \\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("I think \\boxed{3}", "4", 0.0),
        ("x = 2 + 2 = \\boxed{4}", "$4$", 1.0),
        ("no answer here", "4", 0.0),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("The total is \\boxed{\\$23.40}", "\\$23.40", 1.0),  # an escaped dollar: currency, not math mode
        ("\\boxed{23.4}", "\\$23.40", 1.0),
        ("\\boxed{23.5}", "\\$23.40", 0.0),
    ],
)
def test_math_correct(response: str, answer: str, expected: float) -> None:
    assert math_correct(sample(response, answer)) == expected


def test_math_correct_answers_a_repeated_response_from_its_cache() -> None:
    from moe_rl.rewards.rules import _math_equal

    first = math_correct(sample("so \\boxed{12}", "12"))
    hits = _math_equal.cache_info().hits
    assert math_correct(sample("so \\boxed{12}", "12")) == first == 1.0
    assert _math_equal.cache_info().hits == hits + 1
    assert math_correct(sample("so \\boxed{12}", "13")) == 0.0  # keyed by the answer too


def test_format_and_length() -> None:
    assert format_reward(sample("answer \\boxed{7}")) == 1.0
    assert format_reward(sample("answer 7")) == 0.0
    assert format_reward(sample("<answer>7</answer>"), pattern=r"<answer>.+</answer>") == 1.0
    assert length_reward(sample("x", n=100), budget=100) == 1.0
    assert length_reward(sample("x", n=150), budget=100) == pytest.approx(0.5)
    assert length_reward(sample("x", n=400), budget=100) == 0.0
    assert length_reward(sample("abcd"), budget=2) == 0.0  # characters when tokens unknown


@pytest.mark.parametrize("n, expected", [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (20, -1.0)])
def test_overlong_penalty_is_dapos_soft_punishment(n: int, expected: float) -> None:
    # DAPO eq. 13 with L_max = 16, L_cache = 4: 0 below 12 tokens, (12 - n) / 4 up to 16, -1 past it
    at_limit = RewardInput(prompt="q", response="r", num_response_tokens=n, max_response_tokens=16)
    assert overlong_penalty(at_limit, buffer=4) == pytest.approx(expected)
    assert overlong_penalty(sample("r", n=n), buffer=4, max_tokens=16) == pytest.approx(expected)
    with pytest.raises(ValueError, match="needs the response's token count and the sampling limit"):
        overlong_penalty(sample("r", n=n), buffer=4)


def _raises(s: RewardInput) -> float:
    raise RuntimeError("boom")


def _hangs(s: RewardInput) -> float:
    time.sleep(30)
    return 1.0


def _nan(s: RewardInput) -> float:
    return float("nan")


def _text(s: RewardInput) -> str:
    return "not a number"


CALLING_THREADS: list[int] = []


def _thread_id(s: RewardInput) -> float:
    CALLING_THREADS.append(threading.get_ident())
    return 1.0


def test_scorer_columns_weights_and_conditionals() -> None:
    scorer = RewardScorer(
        [
            RewardSpec("correct", "math_correct"),
            RewardSpec("format", "format", weight=0.5),
            RewardSpec("short", "length", weight=0.2, kwargs={"budget": 10}),
        ],
        conditionals=[ConditionalSpec(target="short", condition="correct", threshold=1.0)],
    )
    batch = scorer.score([sample("\\boxed{4}", "4", n=5), sample("\\boxed{5}", "4", n=5), sample("4", "4", n=30)])
    assert batch.names == ["correct", "format", "short"]
    assert torch.equal(batch.values, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(batch.total(), torch.tensor([1.7, 0.5, 1.0]))
    assert torch.equal(batch.column("format"), torch.tensor([1.0, 1.0, 0.0]))


@pytest.mark.parametrize(
    "workers", [0, pytest.param(2, marks=pytest.mark.distributed)], ids=["threads", "process-pool"]
)
def test_failing_rewards_score_zero_are_counted_and_never_raise(workers: int) -> None:
    """In this process or in worker processes (where a hung call's worker is killed and
    replaced), every failure scores 0 and is counted; the other rewards are unaffected."""
    here = __name__
    scorer = RewardScorer(
        [
            RewardSpec("ok", "format"),
            RewardSpec("raises", f"{here}:_raises"),
            RewardSpec("hangs", f"{here}:_hangs"),
            RewardSpec("nan", f"{here}:_nan"),
            RewardSpec("text", f"{here}:_text"),
            RewardSpec("no_answer", "math_correct"),
        ],
        # a worker's round trip must never come near it, even on a loaded machine
        timeout_s=0.2 if workers == 0 else 2.0,
        workers=workers,
    )
    start = time.monotonic()
    batch = scorer.score([sample("\\boxed{1}"), sample("none")])
    assert time.monotonic() - start < 5 + 10 * workers  # the hanging reward did not block the run (pool: 2 restarts)
    assert torch.equal(batch.values[:, 0], torch.tensor([1.0, 0.0]))
    assert torch.equal(batch.values[:, 1:], torch.zeros(2, 5))
    assert batch.failures["raises"]["error"] == 2
    assert batch.failures["hangs"]["timeout"] == 2
    assert batch.failures["nan"]["nonfinite"] == 2
    assert batch.failures["text"]["error"] == 2
    assert batch.failures["no_answer"]["error"] == 2
    assert sum(batch.failures["ok"].values()) == 0
    scorer.score([sample("x")])
    assert scorer.failure_totals["raises"]["error"] == 3
    if workers:  # each hung call cost its worker; the pool is whole again
        pool = scorer._pool
        assert pool.restarts == 3 and all(p.is_alive() for p, _ in pool._workers) and len(pool._workers) == 2
    scorer.close()


def _sleeps(s: RewardInput) -> float:
    time.sleep(30 if s.response == "hang" else float(s.response))
    return 1.0


def _slow_to_warm(s: RewardInput) -> float:
    return 1.0


_slow_to_warm.warm_up = lambda: time.sleep(1.5)  # type: ignore[attr-defined]  # longer than the timeout


@pytest.mark.distributed
def test_a_workers_warm_up_is_not_charged_to_its_tasks_and_unpicklable_inputs_score_zero() -> None:
    """A reward whose warm-up outlasts the timeout: every task still scores, also after a
    replacement worker (whose warm-up came before its first task: it was charged to the
    task, which timed out, killing the worker, forever). A task whose metadata cannot be
    pickled (a lambda a generate function kept) scores 0 as an error instead of raising."""
    scorer = RewardScorer(
        [RewardSpec("t", f"{__name__}:_slow_to_warm"), RewardSpec("hangs", f"{__name__}:_hangs")],
        timeout_s=1.0,
        workers=1,
    )
    try:
        unpicklable = RewardInput(prompt="q", response="r", metadata={"handle": lambda: 0})
        batch = scorer.score([sample("a"), unpicklable, sample("b")])
        assert batch.values[:, 0].tolist() == [1.0, 0.0, 1.0] and batch.failures["t"]["error"] == 1
        assert batch.failures["hangs"]["timeout"] == 2 and batch.failures["t"]["timeout"] == 0
    finally:
        scorer.close()


@pytest.mark.distributed
def test_pool_keeps_an_answer_that_came_while_another_worker_was_replaced() -> None:
    # worker A hangs (deadline 2 s); B answers at 1 s, then takes the 1.4 s task (deadline
    # 3 s) and answers at 2.4 s, while A's replacement is starting (a spawn: ~2 s)
    scorer = RewardScorer([RewardSpec("t", f"{__name__}:_sleeps")], timeout_s=2.0, workers=2)
    batch = scorer.score([sample("hang"), sample("1.0"), sample("1.4")])
    scorer.close()
    assert batch.failures["t"]["timeout"] == 1 and torch.equal(batch.values[:, 0], torch.tensor([0.0, 1.0, 1.0]))


def test_in_process_rewards_share_one_thread_until_a_call_hangs() -> None:
    CALLING_THREADS.clear()
    scorer = RewardScorer(
        [RewardSpec("id", f"{__name__}:_thread_id"), RewardSpec("hangs", f"{__name__}:_hangs")], timeout_s=0.2
    )
    scorer.score([sample("a"), sample("b"), sample("c")])  # id x3 on one thread; hangs: the first call times out
    scorer.score([sample("d")])
    first, later = CALLING_THREADS[:3], CALLING_THREADS[3]
    assert len(set(first)) == 1 and first[0] != threading.get_ident()  # one reward thread, not the caller
    assert later != first[0]  # its thread was left with the hung call: a fresh one took over


def test_each_in_process_call_gets_the_timeout_from_when_the_one_before_it_ended() -> None:
    """Three calls of 0.3 s under a 0.5 s timeout: the batch takes 0.9 s, no call times out;
    a call of 30 s among them does, and the calls after it still score on a fresh thread."""
    scorer = RewardScorer([RewardSpec("t", f"{__name__}:_sleeps")], timeout_s=0.5)
    start = time.monotonic()
    batch = scorer.score([sample("0.3"), sample("0.3"), sample("0.3")])
    assert time.monotonic() - start >= 0.9
    assert sum(batch.failures["t"].values()) == 0 and batch.values[:, 0].tolist() == [1.0, 1.0, 1.0]
    batch = scorer.score([sample("0.01"), sample("hang"), sample("0.01")])
    assert batch.failures["t"] == {"timeout": 1} and batch.values[:, 0].tolist() == [1.0, 0.0, 1.0]


def _slow_warm_up(s: RewardInput) -> float:
    return 1.0


_slow_warm_up.warm_up = lambda: time.sleep(30)


def test_a_warm_up_is_not_charged_to_the_first_calls_but_a_hung_one_is_left_behind(monkeypatch, caplog) -> None:
    monkeypatch.setattr(scorer_module, "WARM_UP_TIMEOUT_S", 0.5)
    scorer = RewardScorer([RewardSpec("w", f"{__name__}:_slow_warm_up")], timeout_s=0.1)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=scorer_module.__name__):
        batch = scorer.score([sample("a"), sample("b")])
    assert 0.5 <= time.monotonic() - start < 5  # waited for the warm-up's allowance, not the call's 0.1 s
    assert batch.values[:, 0].tolist() == [1.0, 1.0] and sum(batch.failures["w"].values()) == 0
    assert "warm-up ran past 0.5 s" in caplog.text


WARMED: list[int] = []


def _warmed(s: RewardInput) -> float:
    return float(len(WARMED))


_warmed.warm_up = lambda: WARMED.append(threading.get_ident())


def test_a_reward_is_warmed_up_on_its_thread_before_the_first_score() -> None:
    WARMED.clear()
    scorer = RewardScorer([RewardSpec("w", f"{__name__}:_warmed")])
    assert scorer.score([sample("a")]).values.tolist() == [[1.0]]  # warmed once, before the call
    assert WARMED != [threading.get_ident()]  # not on the caller's thread
    scorer.score([sample("b")])
    assert len(WARMED) == 1


def test_math_correct_warm_up_leaves_results_unchanged() -> None:
    math_correct.warm_up()
    assert (
        math_correct(RewardInput("q", "\\boxed{13}", "13")) == 1.0
        and math_correct(RewardInput("q", "\\boxed{1c1}", "13")) == 0.0
    )


@pytest.mark.parametrize(
    "specs, conditionals, message",
    [
        ([], [], "at least one reward"),
        ([RewardSpec("a", "format"), RewardSpec("a", "length")], [], "unique"),
        ([RewardSpec("a", "nope")], [], "unknown reward function 'nope'"),
        ([RewardSpec("a", "no.such.module:fn")], [], "cannot import"),
        ([RewardSpec("a", "format")], [ConditionalSpec("a", "b")], "unknown reward 'b'"),
    ],
)
def test_scorer_config_errors(specs, conditionals, message) -> None:
    with pytest.raises(ValueError, match=message):
        RewardScorer(specs, conditionals)


def test_resolve_user_function_by_import_path() -> None:
    assert resolve_reward_fn("moe_rl.rewards.rules:length_reward") is length_reward


def test_rewards_score_the_response_with_special_tokens_skipped_unless_kept() -> None:
    """As TRL, verl and SGLang's own ``text``: a special token inside a response (here the
    demo tokenizer's ``<pad>``) is not in the text the rewards score; with
    ``reward.keep_special_tokens`` it is, and only a final EOS is cut."""
    from moe_rl.data.tokenizer import demo_tokenizer
    from moe_rl.experience.collector import _response_texts
    from moe_rl.rollout.types import Sample

    tok = demo_tokenizer()
    pad, eos = tok.pad_token_id, tok.eos_token_id
    ids = [*tok.encode("1"), pad, *tok.encode("2"), eos]

    def sample(output_ids: list[int]) -> Sample:
        return Sample([], output_ids, [0.0] * len(output_ids), "stop", "0", 0)

    assert _response_texts([sample(ids)], tok) == ["12"]
    assert _response_texts([sample(ids)], tok, keep_special_tokens=True) == ["1<pad>2"]
    assert _response_texts([sample([*ids, *tok.encode("3")])], tok, keep_special_tokens=True) == ["1<pad>2<eos>3"]


@pytest.mark.parametrize(
    "workers", [0, pytest.param(2, marks=pytest.mark.distributed)], ids=["threads", "process-pool"]
)
def test_groups_submitted_early_score_as_one_batch_would(workers: int) -> None:
    """Submitted group by group (as groups finish generating) and gathered at the end: the
    same table, failures and totals as scoring the batch at once; a reward that raises,
    hangs (threads: the pool's timeouts are test_failing_rewards_...'s) or returns NaN scores 0
    and is counted alike; submit returns before scoring."""
    here = __name__
    specs = [
        RewardSpec("correct", "math_correct"),
        RewardSpec("short", "length", weight=0.2, kwargs={"budget": 10}),
        RewardSpec("raises", f"{here}:_raises"),
        RewardSpec("nan", f"{here}:_nan"),
    ] + ([RewardSpec("hangs", f"{here}:_hangs")] if workers == 0 else [])
    conditionals = [ConditionalSpec(target="short", condition="correct", threshold=1.0)]
    inputs = [sample(r, "4", n) for r, n in (("\\boxed{4}", 5), ("\\boxed{5}", 5), ("4", 30), ("\\boxed{4}", 20))]
    scorer = RewardScorer(specs, conditionals, timeout_s=0.2 if workers == 0 else 2.0, workers=workers)
    expected = scorer.score(inputs)  # at once (before any submission: not through the feeder)
    start = time.monotonic()
    pending = [scorer.submit(inputs[i : i + 2]) for i in (0, 2)]
    assert time.monotonic() - start < 0.2  # handed over, not scored (threads: a hung call is still ahead)
    got = scorer.gather(pending)
    assert torch.equal(got.values, expected.values) and got.names == expected.names and got.weights == expected.weights
    assert got.failures == expected.failures and got.failures["raises"]["error"] == 4
    assert scorer.failure_totals == {n: c + c for n, c in expected.failures.items()}
    if workers == 0:
        assert got.failures["hangs"]["timeout"] == 4
    assert torch.equal(scorer.score(inputs[:1]).values, expected.values[:1])  # later scoring goes through the feeder
    scorer.close()


def test_a_worker_that_dies_at_start_is_named_with_its_exit_code() -> None:
    """Not a bare EOFError from the pipe its death closed."""
    from moe_rl.rewards.pool import RewardPool

    with pytest.raises(RuntimeError, match=r"reward worker \d+ exited with code 1 within .*fails to import"):
        RewardPool(1, 5.0, ["no_such_module_xyz:reward"])
