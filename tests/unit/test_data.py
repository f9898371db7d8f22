"""Datasets (JSONL, Parquet, `datasets` directories, field names, chat rows), prompt
formatting with a chat template, DAPO dynamic sampling, pass@k evaluation and the
learning-rate schedule, in process."""

from __future__ import annotations

import itertools
import statistics
import json
import math
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.data.prompts import PromptFormatter
from moe_rl.data.tasks import DatasetTask, Problem, make_task
from moe_rl.data.tokenizer import demo_tokenizer
from moe_rl.rollout.types import RolloutEngine, Sample

# a chat template written in the demo tokenizer's characters
CHAT = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = demo_tokenizer()
    tok.chat_template = CHAT
    return tok


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_parquet_and_datasets_dirs_with_custom_fields(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"question": "1+2=", "meta": {"solution": 3}},
        {"question": "", "meta": {"solution": 1}},
        {"question": "4+4=", "meta": {}},
        {"question": "5+1=", "meta": {"solution": 6}},
    ]
    expected = [Problem("1+2=", "3"), Problem("5+1=", "6")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    ).save_to_disk(str(tmp_path / "two"))
    for spec in (
        str(tmp_path / "d.parquet"),
        str(tmp_path / "one"),
        f"{tmp_path / 'two'}:train",
        write_jsonl(tmp_path / "d.jsonl", rows),
    ):
        task = DatasetTask(spec, prompt_key="question", answer_key="meta.solution")
        assert task.items == expected, spec
        assert len(task.skipped) == 2 and ("row 1" in task.skipped[0] or ":2:" in task.skipped[0]), task.skipped
    assert DatasetTask(f"{tmp_path / 'two'}:test", "question", "meta.solution").items == expected[:1]
    with pytest.raises(ValueError, match="holds the splits train, test: name one, as .*two:train"):
        make_task(str(tmp_path / "two"))
    with pytest.raises(ValueError, match="holds no usable problems"):
        make_task(str(tmp_path / "d.parquet"))  # the default field names are not there


def test_chat_rows_and_the_step_order(tmp_path: Path) -> None:
    verl_row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
        "reward_model": {"ground_truth": "4"},
    }
    path = write_jsonl(
        tmp_path / "chat.jsonl", [verl_row, {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}]
    )
    task = DatasetTask(path, answer_key="reward_model.ground_truth")
    assert task.holds_messages and len(task.items) == 1 and len(task.skipped) == 1
    assert task.items[0].prompt == "2+2=" and task.items[0].messages == tuple(verl_row["prompt"])
    # a reply after the last user message (an SFT row's answer) is cut; no user message: skipped
    sft = [*verl_row["prompt"], {"role": "assistant", "content": "\\boxed{4}"}]
    rows = [{"prompt": sft, "answer": "4"}, {"prompt": [{"role": "system", "content": "Hi."}], "answer": "1"}]
    cut = DatasetTask(write_jsonl(tmp_path / "sft.jsonl", rows))
    assert [p.messages for p in cut.items] == [tuple(verl_row["prompt"])]
    assert cut.skipped[0].endswith('needs a user message in the chat in "prompt"')
    many = DatasetTask(write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"{i}=", "answer": i} for i in range(5)]))
    seen = [p.prompt for step in range(5) for p in many.problems(seed=3, step=step, count=2)]
    assert sorted(seen[:5]) == sorted(p.prompt for p in many.items)  # each row once per epoch
    assert seen == [p.prompt for step in range(5) for p in many.problems(seed=3, step=step, count=2)]  # deterministic
    assert many.eval_problems(3) == many.items[:3] and many.eval_problems(0) == many.items


def test_answers_read_as_the_rewards_need_them_and_rows_as_written(tmp_path: Path) -> None:
    """Float answers in positional notation (``str`` gives 1e-05, whose e math-verify reads
    as Euler's number); a list answer skipped; a byte-order mark; a flattened dotted key."""
    rows = [
        {"prompt": "a", "answer": 1e-05},
        {"prompt": "b", "answer": 2.5e16},
        {"prompt": "c", "answer": 5.0},
        {"prompt": "d", "answer": ["5", "five"]},
        {"prompt": "e", "answer": 7},
    ]
    path = tmp_path / "bom.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8-sig")
    task = DatasetTask(str(path))
    assert [(p.prompt, p.answer) for p in task.items] == [
        ("a", "0.00001"),
        ("b", "25000000000000000"),
        ("c", "5"),
        ("e", "7"),
    ]
    assert task.skipped == [f'{path}:4: needs a text or number answer in "answer", not a list']
    flat = DatasetTask(
        write_jsonl(tmp_path / "flat.jsonl", [{"prompt": "q", "reward_model.ground_truth": "3"}]),
        answer_key="reward_model.ground_truth",
    )
    assert [p.answer for p in flat.items] == ["3"]


@pytest.mark.parametrize("spec, operands", [("arithmetic", 2), ("arithmetic_chain", 3)])
def test_held_out_problems_are_distinct_fixed_and_never_drawn_for_training(spec: str, operands: int) -> None:
    import random

    plain, held = make_task(spec, max_operand=9), make_task(spec, max_operand=9, held_out=64)
    # without held-out problems the stream is the seeded draw it always was: operands in order
    rng = random.Random(7 * 1_000_003 + 3)
    draws = [[rng.randint(0, 9) for _ in range(operands)] for _ in range(50)]
    want = [f"{a}+{b}=" for a, b in draws] if operands == 2 else [f"{a}*{b}+{c}=" for a, b, c in draws]
    assert [p.prompt for p in plain.problems(7, 3, 50)] == want
    evaluated = held.eval_problems(0)
    assert len({p.prompt for p in evaluated}) == 64 and held.eval_problems(16) == evaluated[:16]
    assert make_task(spec, max_operand=9, held_out=64).eval_problems(0) == evaluated  # the same choice every time
    trained = {p.prompt for step in range(600) for p in held.problems(seed=1, step=step, count=32)}
    assert not trained & {p.prompt for p in evaluated}
    assert len(trained) == 10**operands - 64  # everything else is drawn
    for p in evaluated:  # answers are the problems' own
        assert int(p.answer) == eval(p.prompt.rstrip("="))


def test_held_out_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"held_out=100 must be in \[0, 100\)"):
        make_task("arithmetic", max_operand=9, held_out=100)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for bad, match in [
        (["data.held_out=8", "data.eval_max_prompts=16"], "eval_max_prompts=16 exceeds data.held_out=8"),
        (["data.held_out=8", f"data.task={tmp_path / 'd.jsonl'}"], "applies to the built-in tasks"),
        (["data.held_out=100"], r"data.held_out=100 must be in \[0, 100\)"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, bad)


def test_prompt_formatting(tokenizer) -> None:
    problem = Problem("1+2=", "3")
    plain = PromptFormatter(tokenizer, template="{prompt} put it in \\boxed{}")
    assert plain.text(problem) == "1+2= put it in \\boxed{}"
    chat = PromptFormatter(tokenizer, system_prompt="Add.", chat_template=True)
    assert chat.text(problem) == "s: Add. u: 1+2= a:"
    chat_row = Problem("2+2=", "4", ({"role": "system", "content": "Sum."}, {"role": "user", "content": "2+2="}))
    assert chat.text(chat_row) == "s: Sum. u: 2+2= a:"  # the row's own system message is kept
    ids, truncated = chat.encode(problem)
    assert tokenizer.decode(ids) == "s: Add. u: 1+2= a:" and not truncated
    short = PromptFormatter(tokenizer, chat_template=True, max_tokens=4)
    ids, truncated = short.encode(problem)
    assert truncated and tokenizer.decode(ids) == "= a:"  # the end of the prompt is kept
    with pytest.raises(ValueError, match="set data.chat_template=true"):
        plain.text(chat_row)
    with pytest.raises(ValueError, match="must contain \\{prompt\\}"):
        PromptFormatter(tokenizer, template="Q:")
    bare = demo_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="the model's tokenizer has no chat template"):
        PromptFormatter(bare, chat_template=True)


class ScriptedEngine(RolloutEngine):
    """Prompt ``q<N>=``: sample 0 answers ``\\boxed{N}`` when N is even, every other sample
    (and every sample of an odd N) answers ``no``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[list[str]] = []

    @property
    def weight_version(self) -> str:
        return "0"

    def generate(self, prompts, n, params, *, seed, return_routed_experts=False):
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.calls.append(texts)
        groups = []
        for prompt, text in zip(prompts, texts):
            k = int(text[1:-1])
            replies = [f"\\boxed{{{k}}}" if k % 2 == 0 and j == 0 else "no" for j in range(n)]
            groups.append(
                [
                    Sample(list(prompt), ids, [0.0] * len(ids), "stop", "0", seed)
                    for ids in (self.tokenizer(r)["input_ids"] for r in replies)
                ]
            )
        return groups

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        raise AssertionError("not used")


def collector_for(tmp_path: Path, tokenizer, numbers: list[int], *overrides: str):
    from moe_rl.experience.collector import ExperienceCollector
    from moe_rl.rollout.single_turn import SingleTurnSampler
    from moe_rl.experience.builders import build_scorer, sampling_params

    data = write_jsonl(tmp_path / "q.jsonl", [{"prompt": f"q{k}=", "answer": k} for k in numbers] + ["not json"])
    cfg = load_config(
        None,
        [
            "rollout.group_size=4",
            "rollout.prompts_per_step=4",
            f"data.task={data}",
            "reward.rewards=[{name: correct, fn: math_correct}]",
            "reward.conditionals=[]",
            *overrides,
        ],
    )
    engine = ScriptedEngine(tokenizer)
    collector = ExperienceCollector(
        rollout=cfg.rollout,
        advantage=cfg.algorithm.advantage,
        seed=cfg.train.seed,
        task=make_task(data),
        formatter=PromptFormatter(tokenizer),
        engine=engine,
        sampler=SingleTurnSampler(engine),
        scorer=build_scorer(cfg),
        sampling=sampling_params(cfg, tokenizer.eos_token_id),
        return_routing=False,
    )
    return collector, engine


def test_dynamic_sampling_keeps_groups_with_unequal_rewards(tmp_path: Path, tokenizer) -> None:
    dynamic = ["rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.max_rounds=4"]
    collector, engine = collector_for(tmp_path, tokenizer, list(range(12)), *dynamic)
    exp, scalars = collector.collect(step=0)

    def even(texts: list[str]) -> list[str]:
        return [t for t in texts if int(t[1:-1]) % 2 == 0]

    sampled = [t for call in engine.calls for t in call]
    mixed = even(sampled)
    assert len(even(sampled[:-4])) < 4 and (len(mixed) >= 4 or len(engine.calls) == 4)  # rounds until 4 groups are kept
    assert len(engine.calls) > 1 and len(set(map(tuple, engine.calls))) == len(engine.calls)  # other prompts each round
    assert [tokenizer.decode(s.prompt_ids) for s in exp.samples[::4]] == mixed[:4]
    assert all(float(exp.advantages[i * 4 : i * 4 + 4].abs().sum()) > 0 for i in range(4))
    assert scalars["data/sampling_rounds"] == len(engine.calls)
    assert scalars["data/kept_group_frac"] == pytest.approx(len(mixed) / len(sampled))
    assert scalars["reward/correct"] == pytest.approx(len(mixed) / (4 * len(sampled)))  # over everything sampled
    assert scalars["data/skipped_lines"] == 1
    assert (
        scalars["reward/distinct_totals_per_group"] == 2.0 == scalars["advantage/distinct_per_group"]
    )  # 1 right, 3 wrong

    plain, engine = collector_for(tmp_path, tokenizer, list(range(12)))
    exp, scalars = plain.collect(step=0)
    assert len(engine.calls) == 1 and len(exp.samples) == 16 and "data/kept_group_frac" not in scalars

    hopeless, engine = collector_for(tmp_path, tokenizer, [1, 3, 5, 7, 9], *dynamic)
    exp, scalars = hopeless.collect(step=0)  # nothing to keep in 4 rounds: the first round, all zero advantage
    assert len(engine.calls) == 4 and scalars["data/kept_group_frac"] == 0.0
    assert [tokenizer.decode(s.prompt_ids) for s in exp.samples[::4]] == engine.calls[0] and float(
        exp.advantages.abs().sum()
    ) == 0


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n responses (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n: int) -> None:
    from moe_rl.experience.evaluation import pass_at_k

    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k)), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(n, n + 1, 1)


def test_evaluator_scores_held_out_problems(tmp_path: Path, tokenizer) -> None:
    from moe_rl.experience.evaluation import Evaluator

    collector, engine = collector_for(tmp_path, tokenizer, [0, 1, 2, 3, 4])
    problems = collector.task.eval_problems(0)
    evaluator = Evaluator(
        problems,
        collector.formatter,
        collector.sampler,
        collector.scorer,
        collector.sampling,
        samples=4,
        solved_reward="correct",
        prompts_per_request=2,
        progress=False,
    )
    scalars = evaluator.run()
    assert engine.calls == [["q0=", "q1="], ["q2=", "q3="], ["q4="]]
    solved = [1, 0, 1, 0, 1]  # correct responses of 4 per problem
    assert scalars["eval/pass@1"] == pytest.approx(sum(brute_force_pass_at_k(4, c, 1) for c in solved) / 5)
    assert scalars["eval/pass@4"] == pytest.approx(3 / 5)
    assert scalars["eval/reward/correct"] == pytest.approx(3 / 20) and scalars["eval/prompts"] == 5


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_follows_its_definition(schedule: str) -> None:
    from parallel.optim import OptimSettings, build_lr_scheduler

    lr, min_lr, warmup, steps = 1e-3, 1e-4, 3, 10
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_lr_scheduler(
        optimizer, OptimSettings(lr=lr, min_lr=min_lr, lr_schedule=schedule, warmup_steps=warmup), steps
    )

    def expected(s: int) -> float:  # the documented schedule (parallel/optim.py, OptimSettings)
        if s < warmup:
            return lr * (s + 1) / warmup
        progress = (s + 1 - warmup) / (steps + 1 - warmup)  # reaches min_lr one step after the last
        if schedule == "constant":
            return lr
        decay = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return min_lr + (lr - min_lr) * decay

    for s in [7, 0, 9, 2, 3, 5]:  # any order: a resumed run starts anywhere
        assert sched.set_step(s) == pytest.approx(expected(s)) and optimizer.param_groups[0]["lr"] == pytest.approx(
            expected(s)
        )
    assert expected(steps - 1) > min_lr or schedule == "constant"
    with pytest.raises(ValueError, match="optim.warmup_steps=10 must be below the decay horizon \\(train.steps=10\\)"):
        build_lr_scheduler(optimizer, OptimSettings(warmup_steps=10), steps)


def test_compare_report_shows_expert_bias_only_for_runs_that_have_one() -> None:
    from moe_rl.report import expert_bias_table

    glm = {
        "routing/expert_bias_delta/mean": {1: 0.01, 2: 0.02},
        "routing/expert_bias_effect/changed_frac/mean": {1: 0.2, 2: 0.4},
        "routing/changed_frac/mean": {1: 0.3, 2: 0.5},
    }
    assert expert_bias_table({"qwen3": {"routing/changed_frac/mean": {1: 0.3}}}) == []
    lines = expert_bias_table({"glm": glm, "qwen3": {"routing/changed_frac/mean": {1: 0.3}}})
    assert "| glm | 0.01500 | 0.3000 | 0.4000 |" in lines and not any(l.startswith("| qwen3") for l in lines)


def test_compare_report_shows_held_out_evaluation(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from moe_rl.report import read_scalars, write_report

    for name, evals in (("plain", {}), ("evaluated", {0: (0.25, 0.5), 4: (0.5, 0.75)})):
        with SummaryWriter(str(tmp_path / name / "tensorboard")) as writer:
            for step in (1, 2, 3, 4):
                writer.add_scalar("reward/total", step / 10, step)
            for step, (p1, p4) in evals.items():
                writer.add_scalar("eval/pass@1", p1, step)
                writer.add_scalar("eval/pass@4", p4, step)
                writer.add_scalar("eval/reward_mean", p1 * 2, step)
    report = write_report(
        tmp_path, {n: read_scalars(tmp_path / n) for n in ("plain", "evaluated")}, fixed_steps=[2]
    ).read_text()
    section = report.split("## Held-out evaluation")[1].split("## Cost")[0]
    assert "| plain |" not in section and "| plain |" in report.split("## Cost")[1]  # costs: every run
    assert "| evaluated | 0.250 -> 0.500 | 0.500 -> 0.750 | 0.500 -> 1.000 | 4 |" in report
    # a reused run that went on longer than the comparison: read up to the comparison's steps
    assert read_scalars(tmp_path / "plain", up_to=2)["reward/total"] == {1: pytest.approx(0.1), 2: pytest.approx(0.2)}


def test_claim_verdicts_need_an_effect_beyond_the_seed_spread() -> None:
    from moe_rl.claims import Comparison, Side, compare, tag

    def runs(values: dict[str, list[list[float]]]) -> dict[str, dict[str, dict]]:  # run -> seeds -> per-step values
        return {
            name: {str(seed): {"m": dict(enumerate(steps, 1))} for seed, steps in enumerate(seeds, 1)}
            for name, seeds in values.items()
        }

    clear = runs({"a": [[1.0, 1.2], [2.0, 2.2], [3.0, 3.1]], "b": [[0.9, 1.0], [1.8, 2.0], [2.9, 3.0]]})
    out = compare(Comparison(Side("a", tag("m"), "m"), Side("b", tag("m"), "m")), clear)
    # paired by seed: per-seed means a = 1.1, 2.1, 3.05 and b = 0.95, 1.9, 2.95 -> differences .15, .2, .1
    diffs = [0.15, 0.2, 0.1]
    se = statistics.stdev(diffs) / math.sqrt(3)
    assert out.pairs == 3 and out.effect == pytest.approx(0.15) and out.stderr == pytest.approx(se) and out.agrees
    assert out.spread_a == pytest.approx(statistics.stdev([1.1, 2.1, 3.05]))  # the seeds' spread is large ...
    # ... but pairing by seed removes it; a difference inside the paired noise does not agree
    noisy = runs({"a": [[1.0], [2.0], [3.0]], "b": [[0.5], [2.4], [2.9]]})
    assert not compare(Comparison(Side("a", tag("m"), "m"), Side("b", tag("m"), "m")), noisy).agrees
    # 3.5 standard errors with 3 seeds: beyond 2, but not beyond Student's t(2) = 4.30
    three = runs({"a": [[1.1], [2.2], [3.3]], "b": [[1.0], [2.0], [3.0]]})
    out = compare(Comparison(Side("a", tag("m"), "m"), Side("b", tag("m"), "m")), three)
    assert 2 < out.effect / out.stderr < 4.3 and out.threshold == pytest.approx(4.303, abs=1e-3) and not out.agrees
    # "as well as" (at_least): within the margin at the low end agrees; noise alone, or clearly worse, does not
    as_well = lambda margin: Comparison(Side("b", tag("m"), "m"), Side("a", tag("m"), "m"), True, margin)  # noqa: E731
    assert not compare(as_well(0.05), noisy).agrees and not compare(as_well(0.05), clear).agrees
    close = runs({"a": [[1.0], [2.0], [3.0]], "b": [[0.99], [2.0], [2.995]]})
    assert compare(as_well(0.05), close).agrees and not compare(as_well(0.0), close).agrees
    with pytest.raises(ValueError, match="needs a margin"):
        Comparison(Side("b", tag("m"), "m"), Side("a", tag("m"), "m"), at_least=True)
    # equal figures are no effect in the claimed direction
    same = runs({"a": [[1.0], [2.0]], "b": [[1.0], [2.0]]})
    assert not compare(Comparison(Side("a", tag("m"), "m"), Side("b", tag("m"), "m")), same).agrees
    # one seed: paired by step
    one = runs({"a": [[1.0, 2.0, 3.0, 4.0]], "b": [[0.0, 1.1, 1.9, 3.0]]})
    out = compare(Comparison(Side("a", tag("m"), "m"), Side("b", tag("m"), "m")), one)
    assert out.pairs == 4 and out.effect == pytest.approx(1.0) and out.agrees
    assert compare(Comparison(Side("a", tag("m"), "m"), Side("missing", tag("m"), "m")), one) is None
    # pairs are matched by seed, whatever order the runs were listed in
    shuffled = {"a": dict(reversed(clear["a"].items())), "b": clear["b"]}
    assert compare(Comparison(Side("a", tag("m"), "m"), Side("b", tag("m"), "m")), shuffled).effect == pytest.approx(
        0.15
    )
    # several seeds: each run's figure over the steps both logged (a run that went on longer
    # adds none of its later steps: equal figures at every common step are no effect)
    longer = runs({"a": [[1.0, 2.0, 9.0], [1.5, 2.5, 9.0], [1.2, 2.2, 9.0]], "b": [[1.0, 2.0], [1.5, 2.5], [1.2, 2.2]]})
    out = compare(Comparison(Side("a", tag("m"), "m"), Side("b", tag("m"), "m")), longer)
    assert out.pairs == 3 and out.effect == 0.0 and not out.agrees


@pytest.mark.parametrize("dof", [1, 2, 4, 9, 40])
def test_the_t_threshold_is_students_quantile(dof: int) -> None:
    """The threshold's upper tail, integrated from the t density (Simpson's rule over a
    substitution that makes the tail finite), is 2.5%."""
    from moe_rl.claims import t_critical

    t = t_critical(dof)
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    density = lambda x: math.exp(log_norm - (dof + 1) / 2 * math.log1p(x * x / dof))  # noqa: E731
    # x = t / u, u in (0, 1]: the tail is the integral of density(t / u) t / u^2 du
    n, total = 20000, 0.0
    for i in range(n + 1):
        u = max(i / n, 1e-9)
        weight = 1 if i in (0, n) else (4 if i % 2 else 2)
        total += weight * density(t / u) * t / (u * u)
    assert total / (3 * n) == pytest.approx(0.025, rel=1e-4)


def test_claims_yaml_has_every_claims_runs_and_a_comparison_keeps_only_its_own_claims() -> None:
    import yaml

    from moe_rl.claims import CLAIMS, _runs_of, evaluate_claims

    configured = set(yaml.safe_load((Path(__file__).parents[2] / "configs/compare/claims.yaml").read_text())["runs"])
    assert all(_runs_of(claim) <= configured for claim in CLAIMS)
    kept = evaluate_claims({}, compared={"grpo", "grpo_r2"})
    assert [r.claim.statement for r in kept] == [
        c.statement for c in CLAIMS if _runs_of(c) <= {"grpo", "grpo_r2"}
    ] and kept
    assert not any(r.checkable for r in kept)  # no logs: configured, but cannot be checked


def test_compare_report_opens_with_its_conclusions(tmp_path: Path) -> None:
    """The report says in words who learned on held-out problems, who only learned the
    training rewards, what replay changed and why two runs coincide; claim rows name both
    sides; figures in one format per column."""
    from moe_rl.claims import CLAIMS, Outcome, _row
    from moe_rl.report import write_report

    steps = range(1, 6)

    def run(reward: float, replayed: float, engine: float, pass1: tuple[float, float]) -> dict:
        return {
            "reward/total": {s: reward + 0.01 * s for s in steps},
            "routing/replayed/changed_frac/mean": dict.fromkeys(steps, replayed),
            "routing/train_vs_rollout/changed_frac/mean": dict.fromkeys(steps, engine),
            "eval/pass@1": {0: pass1[0], 5: pass1[1]},
        }

    data = {
        "grpo": run(1.0, 0.005, 0.0035, (0.5, 0.7)),
        "grpo_r2": run(1.1, 0.0, 0.001, (0.5, 0.6)),
        "grpo_r3": run(1.1, 0.0, 0.0, (0.5, 0.6)),
        "gmpo": run(1.5, 0.004, 0.001, (0.5, 0.3)),
    }
    report = write_report(tmp_path, data, fixed_steps=[3]).read_text()
    head = report.split("## Conclusions")[1].split("## Runs")[0]
    assert (
        "rose for grpo (0.500 -> 0.700), grpo_r2 (0.500 -> 0.600), grpo_r3 (0.500 -> 0.600); it did not for gmpo (0.500 -> 0.300)"
        in head
    )
    assert "gmpo has the highest final training reward (1.530) but its held-out pass@1 did not rise" in head
    assert (
        "the update passes of grpo_r2, grpo_r3 used exactly the old pass's routing; without replay grpo 0.50%, gmpo 0.40%"
        in head
    )
    assert "grpo_r2 and grpo_r3 have the same training reward at 5 of 5 steps: both replay routing" in head
    assert "| grpo | 1.030 -> 1.030 | 0.500 -> 0.700 | — | 0.35 |" in report  # 3 decimals, percentages
    same_run = CLAIMS[0].comparisons[0]
    outcome = Outcome(0.123456, 0.0456, 0.01, 0.002, 0.0778, 0.001, 5, True)
    assert _row(1, same_run, outcome).startswith(
        "| 1. grpo: A > B | A: mean abs log-ratio, routing changed; B: mean abs log-ratio, routing same | 0.123 ± 0.010 | 0.0456 ± 0.0020 | +0.0778 ± 0.0010 |"
    )
    two_runs = CLAIMS[1].comparisons[0]
    assert _row(2, two_runs, None).startswith("| 2. grpo (A) > grpo_r2 (B) | routing/replayed/changed_frac/mean |")


def test_compare_says_when_it_continues_an_earlier_run_and_fresh_deletes_only_its_own(tmp_path: Path) -> None:
    from moe_rl.commands.compare import earlier_runs, remove_runs, start_line

    out = tmp_path / "runs"
    (out / "configs").mkdir(parents=True)
    assert start_line(out / "grpo", steps=4) == "started"
    for name, step in (("grpo", 4), ("gspo", 2), ("mine", 4)):
        (out / name / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (out / name / "checkpoints" / f"step_{step:06d}" / "meta.json").write_text("{}")
    for name in ("grpo", "gspo"):
        (out / "configs" / f"{name}.yaml").write_text("{}")
    assert "up to step 4, already finished: its results are reused (--fresh" in start_line(out / "grpo", steps=4)
    assert "up to step 2, continuing it" in start_line(out / "gspo", steps=4)
    # only the runs asked for, and only directories compare made (it wrote their config)
    assert remove_runs(earlier_runs(out, ["grpo", "mine", "absent"])) == [out / "grpo"]
    assert not (out / "grpo").exists() and (out / "gspo").is_dir() and (out / "mine").is_dir()


def test_fresh_deletes_nothing_until_every_runs_config_is_good_and_demo_takes_compares_options(tmp_path: Path) -> None:
    import yaml

    from conftest import moe_rl_in_process

    out = tmp_path / "runs"
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({"out_dir": str(out), "runs": {"grpo": {}}}))
    (out / "configs").mkdir(parents=True)
    (out / "configs" / "grpo.yaml").write_text("{}")
    (out / "grpo" / "checkpoints").mkdir(parents=True)  # an earlier run's results
    typo = moe_rl_in_process("compare", "--config", str(spec), "--fresh", "rollout.group_sise=4")
    assert typo.returncode == 2 and "unknown key 'rollout.group_sise'" in typo.stderr, typo.stderr
    assert (out / "grpo" / "checkpoints").is_dir() and "deleted" not in typo.stdout
    assert (out / "configs" / "grpo.yaml").read_text() == "{}"  # no config written for a run that cannot start
    demo = moe_rl_in_process("demo", "--config", str(spec), "rollout.group_sise=4")  # compare's defaults
    assert demo.returncode == 2 and "unknown key 'rollout.group_sise'" in demo.stderr, demo.stderr


def test_compare_reuses_a_finished_run_only_of_the_same_config(tmp_path: Path) -> None:
    from moe_rl.checkpoint.catalog import FORMAT
    from moe_rl.checkpoint.verify import sealed
    from moe_rl.commands.compare import finished_earlier

    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.steps=4"])
    assert not finished_earlier(cfg)  # nothing there
    meta = {"step": 4, "world_size": 1, "format": FORMAT, "fingerprint": cfg.fingerprint()}
    step = tmp_path / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps(sealed(meta, {})))
    assert finished_earlier(cfg)
    assert not finished_earlier(load_config(None, [f"train.run_dir={tmp_path}", "train.steps=6"]))  # continued
    assert not finished_earlier(load_config(None, [f"train.run_dir={tmp_path}", "train.steps=4", "train.seed=9"]))


def test_dynamic_sampling_keeps_a_group_only_if_its_estimator_sees_unequal_rewards(tmp_path: Path, tokenizer) -> None:
    """Two reward columns at equal weights: samples scoring (1, 0) and (0, 1) differ, but their
    totals do not: GRPO gives them zero advantage (dropped), GDPO normalises each column (kept)."""
    from types import SimpleNamespace

    from moe_rl.rewards.base import RewardBatch

    collector, _ = collector_for(tmp_path, tokenizer, list(range(4)), "rollout.dynamic_sampling.enabled=true")
    swapped = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    unequal = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    rewards = RewardBatch(torch.tensor(swapped + unequal), ["a", "b"], [1.0, 1.0])
    sampled = SimpleNamespace(rewards=rewards, samples=[None] * 8)
    kept = {}
    for advantage in ("grpo", "rloo", "gdpo"):
        collector.advantage = advantage
        kept[advantage] = collector._groups_to_keep(sampled)
    assert kept == {"grpo": [1], "rloo": [1], "gdpo": [0, 1]}


def test_eval_refuses_bad_engines_and_outputs_before_evaluating_and_finds_a_runs_config(tmp_path: Path) -> None:
    from conftest import moe_rl_in_process
    from moe_rl.commands.evaluate import _run_config

    base = ["eval", "--checkpoint", str(tmp_path), "--task", "arithmetic"]
    swallowed = moe_rl_in_process(*base, "--engine", "http://h:30000", "data.eval_max_prompts=2")
    assert swallowed.returncode == 2 and "took the override 'data.eval_max_prompts=2'" in swallowed.stderr
    assert "must be a URL" in moe_rl_in_process(*base, "--engine", "foo").stderr
    (tmp_path / "afile").write_text("")
    on_file = moe_rl_in_process(*base, "--out", str(tmp_path / "afile"))
    assert on_file.returncode == 2 and "is a file: it must be a directory" in on_file.stderr
    step = tmp_path / "run" / "checkpoints" / "step_000004"
    (step / "model").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("{}")
    assert _run_config(step) == _run_config(step / "model") == str(tmp_path / "run" / "config.yaml")
    assert _run_config(tmp_path) is None
    assert "--wait-s 0 must be > 0" in moe_rl_in_process(*base, "--engine", "http://h:1", "--wait-s", "0").stderr


def test_eval_gives_up_on_a_server_that_never_answers_after_wait_s(tmp_path: Path) -> None:
    import time

    from conftest import moe_rl_in_process
    from moe_rl.models.tiny import save_tiny_checkpoint
    from parallel.launch import free_port

    model = save_tiny_checkpoint(tmp_path / "model", "qwen3_moe", seed=0)
    start = time.monotonic()
    dead = moe_rl_in_process(
        "eval",
        "--checkpoint",
        str(model),
        "--task",
        "arithmetic",
        "--engine",
        f"http://127.0.0.1:{free_port()}",
        "--wait-s",
        "1",
    )
    assert dead.returncode != 0 and "moe-rl: error: eval: " in dead.stderr and time.monotonic() - start < 60
