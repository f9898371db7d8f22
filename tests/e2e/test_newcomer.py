"""A new user's path: a verl-format chat dataset on the built-in model (its chat template)
and on a model directory of their own, what the model sampled in samples.jsonl and
TensorBoard's text tab, the warning when every reward is equal, and data mistakes that
name their fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SUPPORT, WARM_START, demo_model_dir
from moe_rl.data.prompts import PromptFormatter
from moe_rl.data.tasks import DatasetTask, Problem, field_of
from moe_rl.data.tokenizer import demo_tokenizer

VERL_ROWS = [
    {
        "data_source": "arith",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a}+{b}="}],
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
    }
    for a in range(4)
    for b in range(4)
]


@pytest.fixture(scope="module")
def verl_parquet(tmp_path_factory) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("verl") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    return str(path)


def train(cache: str, run_dir: Path, *overrides: str) -> str:
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
    out = subprocess.run(args, capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def test_a_verl_dataset_trains_with_the_built_in_chat_template_and_shows_its_samples(
    demo_cache, verl_parquet, tmp_path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "verl"
    console = train(
        demo_cache,
        run,
        "train.steps=3",
        f"data.task={verl_parquet}",
        "data.chat_template=true",
        "data.answer_key=reward_model.ground_truth",
        "reward.rewards=[{name: zero, fn: 'multi_turn_fns:always_zero'}]",
        "reward.conditionals=[]",
        "train.flat_reward_steps=2",
        "train.log_samples=2",
    )
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 2, 2, 3, 3]
    # the chat template wrote the last user message as the prompt (the built-in model knows no roles)
    assert {r["prompt"] for r in records} <= {row["prompt"][-1]["content"] for row in VERL_ROWS}
    assert all(
        r["rewards"] == {"zero": 0.0} and r["advantage"] == 0.0 and isinstance(r["response"], str) for r in records
    )
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2, 3] and records[0]["prompt"] in texts[0].tensor_proto.string_val[0].decode()
    # the custom-scalars layout: each per-layer routing chart finds its layers' tags
    import re

    from moe_rl import tags

    assert "custom_scalars__config__" in events.Tags()["tensors"]
    for name, (_, patterns) in tags.CUSTOM_SCALARS_LAYOUT["routing drift per layer"].items():
        assert len([t for t in events.Tags()["scalars"] if re.search(patterns[0], t)]) == 2, (
            name
        )  # the built-in model's 2 layers
    assert (
        console.count("every sample got the rewards (0)") == 1 and "steps 1-2" in console and "samples.jsonl" in console
    )
    assert (
        "step 3/3  reward 0.000" in console and f"checkpoint: {run}/checkpoints/step_000003" in console
    )  # no progress bar: a line a step


def test_a_model_directory_of_the_users_with_a_chat_template(demo_cache, verl_parquet, tmp_path) -> None:
    console = train(
        demo_cache,
        tmp_path / "own",
        "train.steps=1",
        f"model.hf_dir={demo_model_dir(demo_cache)}",
        f"data.task={verl_parquet}",
        "data.chat_template=true",
        "data.answer_key=reward_model.ground_truth",
    )
    assert "1 step(s)" in console and "every sample got" not in console


def test_data_mistakes_name_their_fix(tmp_path, verl_parquet) -> None:
    row = VERL_ROWS[0]
    assert (
        field_of(row, "prompt.-1.content") == "0+0="
        and field_of(row, "prompt.0.role") == "system"
        and field_of(row, "prompt.9.x") is None
    )
    with pytest.raises(ValueError) as wrong_key:
        DatasetTask(verl_parquet)  # answer_key defaults to "answer"
    message = str(wrong_key.value)
    assert (
        "its rows hold the fields data_source, prompt (chat messages), reward_model.style, reward_model.ground_truth"
        in message
    )
    assert "data.answer_key='answer' is not among them (try data.answer_key=reward_model.ground_truth)" in message
    texts = DatasetTask(verl_parquet, prompt_key="prompt.-1.content", answer_key="reward_model.ground_truth")
    assert texts.items[0] == Problem("0+0=", "0") and not texts.holds_messages  # no chat template needed
    tokenizer = demo_tokenizer()
    tokenizer.chat_template = None  # a model without one
    with pytest.raises(
        ValueError, match="add one .*or set data.chat_template=false and point data.prompt_key at .*prompt.-1.content"
    ):
        PromptFormatter(tokenizer, chat_template=True)
    chats = DatasetTask(verl_parquet, answer_key="reward_model.ground_truth")
    assert PromptFormatter(demo_tokenizer(), chat_template=True).text(chats.items[0]) == "0+0="
