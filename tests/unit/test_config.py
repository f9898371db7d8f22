"""Config loading, overrides and validation: every bad value is one clear line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moe_rl.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).parents[2]
GOOD = ROOT / "configs" / "compare" / "demo.yaml"


def test_defaults_and_overrides() -> None:
    cfg = load_config(
        None,
        [
            "algorithm.loss=gspo",
            "optim.lr=1e-4",
            "rollout.group_size=4",
            "routing.replay=r2",
            "algorithm.loss_params={eps_low: 0.0003, eps_high: 0.0004}",
            "reward.timeout_s=2",
        ],
    )
    assert cfg.algorithm.loss == "gspo" and cfg.optim.lr == 1e-4 and cfg.rollout.group_size == 4
    assert cfg.routing.replay == "r2" and cfg.algorithm.loss_params == {"eps_low": 0.0003, "eps_high": 0.0004}
    assert [r.name for r in cfg.reward.rewards] == ["correct", "format", "short"]
    # a string setting takes the text as written, even where YAML would read a mapping or a number
    cfg = load_config(
        None,
        [
            "data.prompt_template={prompt}",
            "train.run_dir=123",
            "data.system_prompt='Be: brief'",
            "data.chat_template=true",
            "model.hf_dir=null",
        ],
    )
    assert (cfg.data.prompt_template, cfg.train.run_dir, cfg.data.system_prompt, cfg.model.hf_dir) == (
        "{prompt}",
        "123",
        "Be: brief",
        None,
    )


def test_run_dir_under_home_is_expanded() -> None:
    """``train.run_dir=~/x`` is the home's x, not a literal ./~ directory."""
    cfg = load_config(overrides=["train.run_dir=~/moe-rl-runs/x"])
    assert cfg.train.run_dir == str(Path.home() / "moe-rl-runs" / "x")


def test_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: {loss: gmpo, loss_params: {log_clip: 0.3}}\ntrain: {steps: 5}\n")
    cfg = load_config(str(path), ["train.steps=7"])
    assert cfg.algorithm.loss_params == {"log_clip": 0.3} and cfg.train.steps == 7


def test_a_moved_rollout_key_keeps_working_with_one_warning_naming_its_new_place(tmp_path: Path, caplog) -> None:
    """Keys that moved into ``rollout``'s sections (server, weight_sync, multi_turn,
    dynamic_sampling) are read at their new place, from a file or an override, with one
    warning line per key and process; old and new both set is refused; a checkpoint's
    fingerprint written under the old names still matches."""
    import moe_rl.config as config
    from moe_rl.config import fingerprint_differences
    from moe_rl.rollout.settings import MOVED_KEYS

    config._WARNED_MOVED.clear()
    path = tmp_path / "old.yaml"
    path.write_text(
        "rollout: {engine: sglang, sglang_urls: ['http://h:1'], weight_sync: disk, sync_bucket_mb: 64,"
        " filter_zero_std_groups: true, max_sampling_rounds: 5, generate_timeout_s: 9, concurrency_per_server: 3}\n"
    )
    with caplog.at_level("WARNING", logger="moe_rl.config"):
        old = load_config(str(path), ["rollout.server_port=31000"])
        load_config(str(path))  # a second load in the process: no second warning
    r = old.rollout
    assert (r.server.urls, r.server.port, r.server.concurrency) == (["http://h:1"], 31000, 3)
    assert (r.weight_sync.method, r.weight_sync.bucket_mb) == ("disk", 64.0)
    assert (r.dynamic_sampling.enabled, r.dynamic_sampling.max_rounds, r.multi_turn.timeout_s) == (True, 5, 9.0)
    lines = [rec.getMessage() for rec in caplog.records]
    assert "config: rollout.sglang_urls is now rollout.server.urls (the old key still works)" in lines
    assert "config: rollout.weight_sync is now rollout.weight_sync.method (the old key still works)" in lines
    assert len(lines) == len(set(lines)) == 8
    new = load_config(
        None,
        [
            "rollout.engine=sglang",
            "rollout.server.urls=[http://h:1]",
            "rollout.server.port=31000",
            "rollout.server.concurrency=3",
            "rollout.weight_sync.method=disk",
            "rollout.weight_sync.bucket_mb=64",
            "rollout.dynamic_sampling.enabled=true",
            "rollout.dynamic_sampling.max_rounds=5",
            "rollout.multi_turn.timeout_s=9",
        ],
    )
    assert new.to_dict() == old.to_dict()
    with pytest.raises(ConfigError, match="rollout.server_port and rollout.server.port are both set"):
        load_config(None, ["rollout.server_port=1", "rollout.server.port=2"])
    renamed = {
        k.replace("rollout.dynamic_sampling.enabled", "rollout.filter_zero_std_groups"): v
        for k, v in new.fingerprint().items()
    }
    assert "rollout.filter_zero_std_groups" in renamed and fingerprint_differences(renamed, new.fingerprint()) == []
    assert fingerprint_differences({**renamed, "rollout.max_sampling_rounds": 2}, new.fingerprint()) == [
        "rollout.dynamic_sampling.max_rounds: 2 -> 5"
    ]
    assert all(
        new.startswith(("server.", "weight_sync.", "multi_turn.", "dynamic_sampling.")) for new in MOVED_KEYS.values()
    )


BAD = [
    (["algorithm.los=gspo"], "unknown key 'algorithm.los' (did you mean 'algorithm.loss'?); valid keys here"),
    (["algorithm.loss=ppo2"], "algorithm.loss='ppo2' is not valid; valid: cispo, gmpo"),
    (["algorithm.advantage=gae"], "algorithm.advantage='gae' is not valid"),
    (["algorithm.loss_params={eps_low: 1.5}"], "algorithm.loss_params.eps_low=1.5 is out of range"),
    (["algorithm.loss_params={eps_high: -0.1}"], "eps_high=-0.1 is out of range"),
    (["algorithm.loss_params={dual_clip: 0.5}"], "dual_clip=0.5 must be > 1"),
    (["algorithm.loss=gmpo", "algorithm.loss_params={log_clip: 0}"], "log_clip=0 must be > 0"),
    (["algorithm.loss=gspo", "algorithm.loss_params={dual_clip: 3}"], "not a parameter of loss 'gspo'"),
    (["algorithm.loss_params={agg: mean}"], "algorithm.loss_params.agg='mean' is not valid"),
    (["algorithm.old_logprobs=cached"], "algorithm.old_logprobs='cached' is not valid"),
    (["algorithm.kl_estimator=k9"], "algorithm.kl_estimator='k9' is not valid"),
    (["algorithm.kl_coef=-1"], "algorithm.kl_coef=-1.0 must be >= 0"),
    (["algorithm.updates_per_batch=0"], "algorithm.updates_per_batch=0 must be > 0"),
    (["routing.replay=r4"], "routing.replay='r4' is not valid; valid: none, r2, r3"),
    (["rollout.engine=vllm"], "rollout.engine='vllm' is not valid"),
    (["rollout.engine=sglang"], "needs rollout.server.urls or rollout.server.launch"),
    (
        ["rollout.engine=sglang", "rollout.server.launch=true", "rollout.server.python=/no/such/python"],
        "rollout.server.python='/no/such/python' is not an executable",
    ),
    (
        ["rollout.engine=sglang", "rollout.server.launch=true", "rollout.server.python=/usr/bin"],
        "rollout.server.python='/usr/bin' is not an executable file",
    ),
    (["rollout.server.start_timeout_s=0"], "rollout.server.start_timeout_s=0.0 must be > 0"),
    (["rollout.group_size=1"], "rollout.group_size=1 must be >= 2"),
    (["rollout.group_size=1", "algorithm.advantage=dr_grpo"], "rollout.group_size=1 must be >= 2"),
    (["rollout.temperature=0"], "rollout.temperature=0.0 must be > 0"),
    (["rollout.top_p=1.5"], "rollout.top_p=1.5 must be in (0, 1]"),
    (["rollout.precision=fp8"], "rollout.precision='fp8' is not valid"),
    (["reward.rewards=[{name: a, fn: nope}]", "reward.conditionals=[]"], "reward.rewards[0].fn='nope' is unknown"),
    (["reward.rewards=[]"], "reward.rewards is empty"),
    (
        ["reward.conditionals=[{target: short, condition: missing}]"],
        "reward.conditionals[0].condition='missing' is not a reward",
    ),
    (["parallel.tp=0"], "parallel.tp=0 must be > 0"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["optim.adam_beta2=1.0"], "optim.adam_beta2=1.0 must be in [0, 1)"),
    (["optim.min_lr=0.1"], "optim.min_lr=0.1 must be in [0, optim.lr=0.0002]"),
    (["optim.weight_decay=-1"], "optim.weight_decay=-1.0 must be >= 0"),
    (["optim.lr=.nan"], "optim.lr=nan must be a finite number"),
    (["parallel.sequence_parallel=maybe"], "parallel.sequence_parallel='maybe' must be true or false"),
    (["algorithm.loss_params={eps_low: abc}"], "algorithm.loss_params.eps_low='abc' must be a finite number"),
    (["algorithm.loss_params={num_tokens: 5}"], "algorithm.loss_params.num_tokens is not a parameter of loss 'grpo'"),
    (["train.steps=abc"], "train.steps='abc' must be an integer"),
    (["train.progress=maybe"], "train.progress='maybe' must be true or false"),
    (["model.hf_dir=/nonexistent"], "model.hf_dir='/nonexistent' has no config.json"),
    (["model.top_k=9"], "model.top_k=9 exceeds model.num_experts=8"),
    (["model.experts=loop"], "model.experts='loop' is not valid; valid: grouped, sequential"),
    (["model.attention=flash"], "model.attention='flash' is not valid; valid: sdpa, local"),
    (
        ["data.task=/no/such.jsonl"],
        "data.task='/no/such.jsonl' is neither a built-in task (arithmetic, arithmetic_chain) nor an existing dataset file",
    ),
    (
        ["data.eval_task=/no/such.parquet"],
        "data.eval_task='/no/such.parquet' is neither a built-in task (arithmetic, arithmetic_chain) nor an existing",
    ),
    ([f"data.task={__file__}"], "a dataset file must end in .jsonl, .json (JSON lines) or .parquet"),
    (["data.prompt_template=Q: {question}"], "data.prompt_template='Q: {question}' must contain {prompt}"),
    (["data.system_prompt=Be brief."], "data.system_prompt needs data.chat_template=true"),
    (["data.eval_task=arithmetic", "data.eval_solved_reward=right"], "data.eval_solved_reward='right' is not a reward"),
    (["data.eval_samples=0"], "data.eval_samples=0 must be > 0"),
    (
        ["algorithm.max_tokens_per_micro_batch=-2"],
        "algorithm.max_tokens_per_micro_batch=-2 must be -1 (derived), 0 (by rows) or a token budget > 0",
    ),
    (["optim.lr_schedule=step"], "optim.lr_schedule='step' is not valid; valid: constant, linear, cosine"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1 must be >= 0"),
    (["train.steps=5", "optim.warmup_steps=5"], "optim.warmup_steps=5 must be below the decay horizon (train.steps=5)"),
    (["train"], "must look like key.sub=value"),
    (["model.hidden_size=0"], "model.hidden_size=0 must be > 0"),
    (["model.hidden_size=30"], "model.hidden_size=30 must be a multiple of 4"),
    (["model.num_layers=-1"], "model.num_layers=-1 must be > 0"),
    (["model.top_k=0"], "model.top_k=0 must be > 0"),
    (["data.max_prompt_tokens=0"], "data.max_prompt_tokens=0 must be > 0"),
    (["data.max_operand=-1"], "data.max_operand=-1 must be >= 0"),
    (["data.held_out=-1"], "data.held_out=-1 must be >= 0"),
    (["rollout.group_size.x=5"], "rollout.group_size is a value, not a section: set it as rollout.group_size=VALUE"),
    (["optim.extra.foo=1"], "optim.extra.foo is not a field of megatron-core's OptimizerConfig"),
    (["optim.extra.lr=0.1"], "optim.extra.lr: moe-rl sets it"),
    (["warm_start.batch_size=0"], "warm_start.batch_size=0 must be > 0"),
    (["warm_start.lr=0"], "warm_start.lr=0.0 must be > 0"),
    (["rollout.server.port=70000"], "rollout.server.port=70000 must be in [1, 65535]"),
    (["rollout.server.mem_fraction_static=1.5"], "rollout.server.mem_fraction_static=1.5 must be in (0, 1]"),
    (["rollout.server.tp=0"], "rollout.server.tp=0 must be > 0"),
    (["rollout.top_k=0"], "rollout.top_k=0 must be -1 (off) or >= 1"),
    (["rollout.temperature=.inf"], "rollout.temperature=inf must be a finite number"),
    (
        ["rollout.engine=sglang", "rollout.server.urls=[localhost:30000]"],
        "rollout.server.urls[0]='localhost:30000' must be a URL",
    ),
    (
        ["reward.rewards=[{name: a, fn: 'no_such_module_xyz:f'}]", "reward.conditionals=[]"],
        "fn='no_such_module_xyz:f' cannot be imported",
    ),
    (["reward.rewards=[{name: a, fn: 'math:pi'}]", "reward.conditionals=[]"], "fn='math:pi' is not callable"),
    (
        ["reward.rewards=[{name: a, fn: format, kwargs: {budget: 3}}]", "reward.conditionals=[]"],
        "fn='format' does not take kwargs ['budget']",
    ),
    (["train.run_dir="], "train.run_dir is empty"),
    (["train.resume_anyway=sometimes"], "train.resume_anyway='sometimes' must be true or false"),
    (
        ["rollout.weight_sync.method=nccl"],
        "rollout.weight_sync.method='nccl' is not valid; valid: distributed, tensor, disk",
    ),
    (["rollout.weight_sync.bucket_mb=0"], "rollout.weight_sync.bucket_mb=0.0 must be > 0"),
    (
        ["rollout.colocate=true"],
        "rollout.colocate=true shares the trainer's GPUs with SGLang servers: it needs rollout.engine=sglang",
    ),
    (
        [
            "rollout.engine=sglang",
            "rollout.server.urls=[http://h:1]",
            "rollout.colocate=true",
            "rollout.async_rollouts=true",
            "algorithm.old_logprobs=rollout",
        ],
        "rollout.colocate=true and rollout.async_rollouts=true exclude each other",
    ),
    (
        ["rollout.engine=sglang", "rollout.server.urls=[http://h:1]", "rollout.colocate=true"],
        "rollout.colocate=true needs rollout.weight_sync.method=tensor (or disk)",
    ),
    (
        ["rollout.async_rollouts=true"],
        "rollout.async_rollouts=true trains on samples of the weights one step behind: set algorithm.old_logprobs=rollout",
    ),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[b[0][-1][:40] for b in BAD])
def test_bad_values_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {}\ntrain: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML: line 3, column 1: expected ',' or ']'"):
        load_config(str(bad))


def test_bad_model_directories(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not readable JSON"):
        load_config(None, [f"model.hf_dir={tmp_path / 'broken'}"])
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="has model_type='llama'; supported: "):
        load_config(None, [f"model.hf_dir={tmp_path / 'dense'}"])
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path))
    # known families whose settings moe-rl cannot reproduce: one line naming the setting
    from moe_rl.models.tiny import tiny_config

    for name, config, needle in [
        (
            "dsv3_bias",
            tiny_config("deepseek_v3", attention_bias=True),
            "attention_bias=True with multi-head latent attention",
        ),
        (
            "glm_yarn",
            tiny_config("glm4_moe", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
            "rope_type='yarn' \\(supported here: default\\)",
        ),
        ("olmoe_clip", tiny_config("olmoe", clip_qkv=8.0), "clip_qkv=8.0 is not supported"),
        (
            "glm_groups",
            tiny_config("glm4_moe", num_experts_per_tok=4),
            "n_group=2 with num_experts_per_tok // topk_group = 4",
        ),
        (
            "glm_unnormalised",
            tiny_config("glm4_moe", norm_topk_prob=False),
            "norm_topk_prob=False with a sigmoid router",
        ),
    ]:
        config.save_pretrained(tmp_path / name)
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [f"model.hf_dir={tmp_path / name}"])
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="is not text"):
        load_config(str(tmp_path / "binary.yaml"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--nproc", "0"], "--nproc 0 must be >= 1"),
        (["export", "--checkpoint", "x", "--out", "{tmp}/work"], "is not empty and was not written by moe-rl export"),
        (["compare", "--config", "{tmp}/shape.yaml"], "runs must map each run name to a mapping"),
        (["compare", "--config", "{tmp}/list.yaml"], "must hold a mapping"),
        (["compare", "--config", str(GOOD), "--seeds", "1,x"], "--seeds '1,x' must be comma-separated integers"),
    ],
)
def test_commands_turn_bad_input_into_one_line(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    from moe_rl.cli import main

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("keep me")
    (tmp_path / "shape.yaml").write_text("runs: [grpo, gspo]\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-rl: error: ") and message in err and err.count("\n") == 1, err
    assert (tmp_path / "work" / "notes.txt").read_text() == "keep me"


def test_cli_reports_one_line_without_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "algorithm.loss=ppo2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip().startswith("moe-rl: error: algorithm.loss='ppo2' is not valid")
        and "Traceback" not in out.stderr
    )


# what a shown config's cluster paths and data fields become here
_HERE = [
    "model.hf_dir=null",
    "data.task=arithmetic",
    "data.eval_task=null",
    "data.chat_template=false",
    "data.prompt_key=prompt",
    "data.answer_key=answer",
]


def _docs_configs(tmp: Path) -> list[Path]:
    """The YAML configs written out in docs/*.md, each as a file."""
    import re

    files = []
    for page in sorted((Path(__file__).parents[2] / "docs").glob("*.md")):
        for n, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)):
            files.append(tmp / f"{page.stem}_{n}.yaml")
            files[-1].write_text(block)
    return files


def test_the_configs_in_the_docs_validate(tmp_path: Path) -> None:
    """docs/training.md's my_run.yaml (and any YAML config a page shows) loads as the
    examples do, with what a real model needs set."""
    (my_run,) = _docs_configs(tmp_path)
    cfg = load_config(str(my_run), _HERE)
    assert cfg.rollout.engine == "sglang" and cfg.rollout.server.launch
    assert cfg.optim.lr == 1e-6 and cfg.parallel.ep == 8


@pytest.mark.parametrize(
    "example", sorted((Path(__file__).parents[2] / "configs" / "examples").glob("*.yaml")), ids=lambda p: p.stem
)
def test_example_configs_validate(example: Path) -> None:
    """The examples hold every setting as the config knows it (their cluster paths replaced)."""
    cfg = load_config(str(example), _HERE)
    assert cfg.rollout.engine == "sglang"


def test_the_readme_config_reference_is_the_codes() -> None:
    """docs/config-reference.md's tables (tools/dev/config_reference.py) list every key with the code's
    default and the comment beside it."""
    from tools.dev import config_reference as tool

    tables = tool.reference()
    assert (
        "| `rollout.max_new_tokens` | `6` | response length limit" in tables
        and "| `train.log_samples` | `4` |" in tables
    )
    assert "|  |\n" not in tables  # every key is explained
    page = (Path(__file__).resolve().parents[2] / "docs" / "config-reference.md").read_text()
    assert tool.page_copy(page) == tables, (
        "docs/config-reference.md is stale: python -m tools.dev.config_reference --write"
    )


def test_the_built_in_model_is_one_model_whatever_the_seed(tmp_path: Path) -> None:
    """train.seed varies the run (data order, sampling), not the built-in model it starts from:
    its cache key has no seed, so seeded first weights made a run's model depend on which
    seed happened to fill the cache first."""
    from safetensors.torch import load_file

    from moe_rl.models.demo_model import _raw_checkpoint, demo_model_dir

    demos = [load_config(None, [f"train.seed={seed}"]).demo_model() for seed in (1, 2)]
    assert demos[0] == demos[1] and demo_model_dir(demos[0]) == demo_model_dir(demos[1])
    for seed, demo in zip((1, 2), demos):
        _raw_checkpoint(demo, tmp_path / str(seed))
    first, second = (load_file(tmp_path / str(seed) / "model.safetensors") for seed in (1, 2))
    assert first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)


@pytest.mark.parametrize("preset", sorted((ROOT / "configs" / "algorithms").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_algorithm_preset_is_a_config_of_its_own(preset: Path) -> None:
    """``moe-rl train --config configs/algorithms/X.yaml`` loads: the preset's algorithm
    section, everything else the defaults."""
    raw = yaml.safe_load(preset.read_text())
    assert set(raw) == {"algorithm"}
    cfg = load_config(str(preset))
    assert (cfg.algorithm.advantage, cfg.algorithm.loss) == (raw["algorithm"]["advantage"], raw["algorithm"]["loss"])
    assert cfg.algorithm.loss_params == raw["algorithm"]["loss_params"]


def test_quoted_text_in_free_form_mappings_stays_text_and_exponents_are_numbers(tmp_path: Path) -> None:
    """YAML 1.2's floats (1e-3: text to PyYAML's YAML 1.1) are numbers, from a file and from an
    override; a quoted "42" stays the text it was written as (it was made 42.0)."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "reward:\n  conditionals: []\n  rewards:\n    - {name: f, fn: format, kwargs: {pattern: '42'}}\n"
        "algorithm:\n  loss_params: {eps_high: 1e-3}\n"
    )
    cfg = load_config(str(path), ["optim.extra.loss_scale=1e2", "optim.lr=5E-6"])
    assert cfg.reward.rewards[0].kwargs == {"pattern": "42"}
    assert cfg.algorithm.loss_params == {"eps_high": 1e-3}
    assert cfg.optim.extra == {"loss_scale": 100.0} and cfg.optim.lr == 5e-6


def test_paths_under_the_home_directory_are_expanded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_config(None, ["model.hf_dir=~/m", "data.task=~/d.jsonl", "data.eval_task=~/e.jsonl"])
    assert (cfg.model.hf_dir, cfg.data.task, cfg.data.eval_task) == (
        f"{tmp_path}/m",
        f"{tmp_path}/d.jsonl",
        f"{tmp_path}/e.jsonl",
    )


def test_a_resume_may_change_how_layers_are_implemented_not_what_they_compute() -> None:
    from moe_rl.config import fingerprint_differences

    base = load_config(None, [])
    switched = load_config(None, ["model.transformer_impl=local", "model.experts=sequential", "model.attention=local"])
    assert fingerprint_differences(base.fingerprint(), switched.fingerprint()) == []
    assert fingerprint_differences(base.fingerprint(), load_config(None, ["model.top_k=1"]).fingerprint()) == [
        "model.top_k: 2 -> 1"
    ]


def test_bad_paths_and_sections_are_named_plainly(tmp_path: Path) -> None:
    """What a user mistyped, named as such: a section that is not a mapping, a path that
    does not exist, a run directory that is a file."""
    from moe_rl.checkpoint.run_dir import check_run_dir, hold_run_dir
    from moe_rl.commands.export import model_dir_of
    from moe_rl.commands.prompt_file import read_prompts
    from moe_rl.models.architectures import load_hf_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: 3\n")
    with pytest.raises(ConfigError, match=r"^algorithm must be a mapping, got 3$"):
        load_config(str(bad))
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"'.*nope' does not exist \(a Hugging Face model directory is needed\)"):
        load_hf_config(missing)
    with pytest.raises(FileNotFoundError, match=r"nope does not exist \(a checkpoint step_N/"):
        model_dir_of(missing)
    with pytest.raises(ValueError, match=r"--prompts '.*nope' cannot be read: No such file or directory"):
        read_prompts(missing, missing, None)
    (tmp_path / "afile").write_text("")
    cfg = load_config(None, [f"train.run_dir={tmp_path / 'afile'}"])
    with pytest.raises(ConfigError, match="is a file: it must be a directory"):
        check_run_dir(cfg)
    with pytest.raises(ConfigError, match="is a file: it must be a directory"):  # what `moe-rl train` meets first
        with hold_run_dir(cfg.train.run_dir):
            pass


def test_the_config_reference_names_every_built_in_architecture() -> None:
    from moe_rl.models.settings import DEMO_ARCHITECTURES

    line = next(
        x for x in (ROOT / "docs" / "config-reference.md").read_text().splitlines() if "`model.architecture`" in x
    )
    assert all(name in line for name in DEMO_ARCHITECTURES), line
