"""Partial rollouts (``rollout.partial``) on the local engine: a response stopped when enough
groups are done continues, after a weight update, to what it would have been uninterrupted
where the weights did not change; each segment keeps its own version, log-probs and
routing; the staleness bound starts old responses over; the carry survives a checkpoint.
(Against the SGLang stand-in and the real server: tests/server/test_partial_rollouts_sglang.py;
kill -9 during a partial run: tests/e2e/test_reliability.py.)"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from conftest import demo_model_dir
from moe_rl.config import ConfigError, load_config
from moe_rl.models.hf_weights import SafetensorsDir
from moe_rl.rollout.local import LocalEngine
from moe_rl.rollout.partial import PartialRollout, joined
from moe_rl.rollout.types import GenerationRequest, Sample, SamplingParams, Segment

# extra stop tokens: response lengths long-tailed (most short, some up to the limit)
PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=(3, 11, 17))
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [6, 7, 8, 9], [7, 8, 9, 10], [8, 9, 10, 11]]
GROUP = 4


@pytest.fixture(scope="module")
def model_dir(demo_cache) -> str:
    return demo_model_dir(demo_cache)


@pytest.fixture
def engine(model_dir) -> LocalEngine:
    return LocalEngine(model_dir)


def hf_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    weights = SafetensorsDir(model_dir)
    return {key: weights.get(key) for key in weights.keys()}


def relabel(engine: LocalEngine, model_dir: str, version: str) -> None:
    """A weight update that leaves the weights as they are (only the version changes)."""
    engine.update_weights(hf_tensors(model_dir), version)


def partial_run(
    engine: LocalEngine, model_dir: str, per_step: int, steps: int, max_staleness: int = 5
) -> tuple[PartialRollout, list]:
    """``steps`` steps of ``per_step`` groups over PROMPTS (fresh prompts in order; the
    version relabelled between steps); every group trained, in order."""
    rollout = PartialRollout(engine, GROUP, per_step, extra_groups=2, max_staleness=max_staleness)
    queue, trained = list(range(len(PROMPTS))), []
    for step in range(steps):
        fresh = [queue.pop(0) for _ in range(min(rollout.fresh_groups_wanted(), len(queue)))]
        got = rollout.sample(fresh, [PROMPTS[i] for i in fresh], PARAMS, seed=0, step=step, routed=True)
        trained += list(zip(got.problems, got.groups))
        relabel(engine, model_dir, str(step + 1))
    return rollout, trained


def test_an_interrupted_response_continues_to_its_uninterrupted_text(engine, model_dir) -> None:
    """Two groups a step (of four started), the rest carried over a weight update that keeps
    the weights: every trained response equals the one generated without interruption
    (tokens and routing exactly, log-probs to rounding), its segments name each version."""
    _, trained = partial_run(engine, model_dir, per_step=2, steps=3)
    reference = LocalEngine(model_dir)
    assert any(s.segments for _, g in trained for s in g), "no response was carried across an update"
    for problem, group in trained:
        for s in group:  # each against the same prompt and seed, never interrupted
            (ref,) = reference.generate_requests(
                [GenerationRequest(PROMPTS[problem], s.seed, 0)], [PARAMS], routed=True, groups_needed=1
            )
            assert s.output_ids == ref.output_ids and s.finish_reason == ref.finish_reason
            assert torch.equal(s.routed_experts, ref.routed_experts)
            assert s.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-5)
            versions = s.token_versions()
            assert len(versions) == len(s.output_ids) and versions == sorted(versions, key=int)
            for a, b in zip(s.segments, s.segments[1:]):
                assert a.start < b.start and int(a.weight_version) < int(b.weight_version)
            assert s.weight_version == versions[0]


def test_each_segment_keeps_its_own_weights_tokens_logprobs_and_routing(engine, model_dir) -> None:
    """Across a real weight change the first segment is the old weights' (its routing is
    not replaced by the continuation's prefill under the new weights) and the second is
    exactly what the new weights generate from prompt + first segment."""
    params = PARAMS
    batch = [GenerationRequest(PROMPTS[0], seed=seed, group=seed) for seed in range(8)]  # one decode batch
    outs = engine.generate_requests(batch, [params] * len(batch), routed=True, groups_needed=1)
    request, first = next((r, s) for r, s in zip(batch, outs) if s.finish_reason == "abort")
    assert 0 < len(first.output_ids) < params.max_new_tokens
    old = LocalEngine(model_dir)  # the weights that drew the first segment
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in hf_tensors(model_dir).items()}
    engine.update_weights(new_weights, "1")
    cont = GenerationRequest(request.token_ids + first.output_ids, request.seed, 0, generated=len(first.output_ids))
    rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(first.output_ids))
    (second,) = engine.generate_requests([cont], [rest], routed=True, groups_needed=1)
    whole = joined(first, second)
    m = len(first.output_ids)
    assert whole.segments == (Segment(0, "0"), Segment(m, "1"))
    assert whole.token_versions() == ["0"] * m + ["1"] * len(second.output_ids)
    assert whole.output_logprobs[:m] == first.output_logprobs and whole.output_logprobs[m:] == second.output_logprobs
    # the old weights' routing of every position up to the last first-segment token
    (old_full,) = old.generate_requests([request], [params], routed=True, groups_needed=1)
    p = len(request.token_ids)
    assert torch.equal(whole.routed_experts[: p + m - 1], old_full.routed_experts[: p + m - 1])
    # from there on, what the new weights chose, as a fresh engine with them computes it
    fresh = LocalEngine(model_dir)
    fresh.update_weights(new_weights, "1")
    (again,) = fresh.generate_requests([cont], [rest], routed=True, groups_needed=1)
    assert again.output_ids == second.output_ids and torch.equal(
        whole.routed_experts[p + m - 1 :], again.routed_experts
    )
    assert whole.routed_experts.shape[0] == p + len(whole.output_ids) - 1


def test_a_response_older_than_the_staleness_bound_starts_over(engine, model_dir) -> None:
    """With max_staleness=1 a response carried over two updates is generated anew from its
    prompt by the weights of the step that trains it."""
    rollout = PartialRollout(engine, GROUP, 1, extra_groups=2, max_staleness=1)
    got = rollout.sample([0, 1, 2], [PROMPTS[i] for i in (0, 1, 2)], PARAMS, seed=0, step=0, routed=False)
    started = sum(1 for g in rollout.carried for s in g.samples if s.output_ids)
    assert got.carried == 2 and started > 0
    relabel(engine, model_dir, "1")
    relabel(engine, model_dir, "2")  # the carry is now two versions old when step 2 generates
    got = rollout.sample([], [], PARAMS, seed=0, step=2, routed=False)
    assert got.restarted == started
    for group in got.groups:
        for s in group:
            assert set(s.token_versions()) == {"2"} and not s.segments


def test_the_carry_survives_a_checkpoint_round_trip(engine, model_dir) -> None:
    """A run resumed from the saved carry generates what the uninterrupted one did."""
    rollout, _ = partial_run(engine, model_dir, per_step=2, steps=1)
    buffer = io.BytesIO()
    torch.save(rollout.state_for(1), buffer)
    restored = PartialRollout(LocalEngine(model_dir), GROUP, 2, extra_groups=2, max_staleness=5)
    relabel(restored.engine, model_dir, "1")
    restored.load_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    a = rollout.sample([4], [PROMPTS[4]], PARAMS, seed=0, step=1, routed=True)
    b = restored.sample([4], [PROMPTS[4]], PARAMS, seed=0, step=1, routed=True)
    assert a.problems == b.problems
    for ga, gb in zip(a.groups, b.groups):
        for sa, sb in zip(ga, gb):
            assert (sa.output_ids, sa.output_logprobs, sa.segments) == (sb.output_ids, sb.output_logprobs, sb.segments)
            assert torch.equal(sa.routed_experts, sb.routed_experts)


def test_the_train_batch_holds_each_tokens_own_behaviour_logprob_and_routing() -> None:
    """TIS / IcePop / the off-policy figures read ``rollout_logp``; R3 replays ``routed_experts``:
    a two-segment sample enters the batch with each segment's own, unchanged."""
    from moe_rl.experience.types import Experience
    from moe_rl.trainer.batch import build_train_batch

    routing = torch.randint(0, 8, (4 + 5 - 1, 2, 2), dtype=torch.uint8)
    first = Sample([1, 2, 3, 4], [5, 6], [-0.5, -0.25], "abort", "3", 1, routing[:5])
    second = Sample([1, 2, 3, 4, 5, 6], [7, 8, 9], [-1.0, -2.0, -3.0], "stop", "4", 1, routing[5:])
    whole = joined(first, second)
    exp = Experience([whole, whole], torch.ones(2, 1), ["r"], torch.tensor([1.0, -1.0]))
    batch = build_train_batch(
        exp, 0, [[0, 1]], seq_len_multiple=1, pad_id=0, device=torch.device("cpu"), with_routing=True
    )
    (mb,) = batch.micro_batches
    assert mb.rollout_logp[0, 3:8].tolist() == [-0.5, -0.25, -1.0, -2.0, -3.0]
    assert torch.equal(mb.routed_experts[0].to(torch.uint8), routing)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.partial.enabled=true"], "algorithm.old_logprobs=rollout"),
        (
            ["rollout.partial.enabled=true", "algorithm.old_logprobs=rollout", "rollout.max_staleness=0"],
            "max_staleness",
        ),
        (
            [
                "rollout.partial.enabled=true",
                "algorithm.old_logprobs=rollout",
                "rollout.async_rollouts=true",
                "rollout.max_staleness=1",
            ],
            "2 or more",
        ),
        (
            ["rollout.partial.enabled=true", "algorithm.old_logprobs=rollout", "rollout.dynamic_sampling.enabled=true"],
            "dynamic_sampling",
        ),
        (
            ["rollout.partial.enabled=true", "algorithm.old_logprobs=rollout", "reward.score_as_finished=true"],
            "score_as_finished",
        ),
        (
            ["rollout.partial.enabled=true", "algorithm.old_logprobs=rollout", "rollout.partial.extra_groups=-1"],
            "extra_groups",
        ),
    ],
)
def test_partial_settings_that_cannot_work_are_refused_in_one_line(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_compare_report_shows_the_staleness_each_run_trained_on() -> None:
    from moe_rl import tags
    from moe_rl.report import staleness_table

    data = {
        "partial": {
            tags.TOKEN_STALENESS_MEAN: {1: 0.0, 2: 0.8},
            tags.TOKEN_STALENESS_MAX: {1: 0.0, 2: 1.0},
            tags.PARTIAL_SAMPLE_FRAC: {1: 0.0, 2: 0.5},
        },
        "async": {tags.ROLLOUT_POLICY_LAG: {1: 0.0, 2: 1.0, 3: 1.0}},
        "plain": {tags.ROLLOUT_POLICY_LAG: {1: 0.0, 2: 0.0}},
    }
    rows = {line.split("|")[1].strip(): line for line in staleness_table(data) if line.startswith("| ")}
    assert set(rows) == {"run", "partial", "async"}  # a run that never trained a stale token is left out
    assert [c.strip() for c in rows["partial"].split("|")[2:5]] == ["0.400", "1.000", "25.00"]
    assert [c.strip() for c in rows["async"].split("|")[2:5]] == ["0.667", "1.000", "—"]
    assert staleness_table({"plain": data["plain"]}) == []


def test_rows_ending_at_the_limit_count_as_done_so_later_batches_do_not_start(engine) -> None:
    """A batch whose rows all end at max_new_tokens completes its groups: with enough groups
    done, the next batch (another prompt length) is never started."""
    limit = dataclasses.replace(PARAMS, max_new_tokens=3, stop_token_ids=(), ignore_eos=True)
    requests = [GenerationRequest(PROMPTS[0], seed=s, group=0) for s in range(2)]
    requests += [GenerationRequest(PROMPTS[0] + [5], seed=s, group=1) for s in range(2)]  # a batch of its own
    outs = engine.generate_requests(requests, [limit] * 4, routed=False, groups_needed=1)
    assert [s.finish_reason for s in outs] == ["length", "length", "abort", "abort"]
    assert [len(s.output_ids) for s in outs] == [3, 3, 0, 0]
