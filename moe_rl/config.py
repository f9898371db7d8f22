"""The run configuration: a typed tree of dataclasses, read from YAML, with dotted
command-line overrides (``algorithm.loss=gspo``), validated before anything starts.
Every error names the key, the value and what would be valid."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from moe_rl.algorithms.settings import AlgorithmConfig
from moe_rl.checks import ConfigError, require_positive
from moe_rl.data.settings import DataConfig
from moe_rl.models.settings import DemoModelSettings, ModelConfig, WarmStartConfig
from moe_rl.rewards.settings import ConditionalItem, RewardConfig, RewardItem
from moe_rl.rollout.settings import MOVED_KEYS, RolloutConfig
from moe_rl.routing.settings import RoutingConfig
from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings

__all__ = [
    "AlgorithmConfig",
    "ConditionalItem",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "RewardConfig",
    "RewardItem",
    "RolloutConfig",
    "RoutingConfig",
    "TrainConfig",
    "WarmStartConfig",
    "fingerprint_differences",
    "load_config",
]


@dataclass
class TrainConfig:
    steps: int = 30  # RL steps
    seed: int = 1  # data order, sampling seeds (not the built-in model: one model whatever the seed)
    run_dir: str = "runs/default"  # checkpoints, metrics.jsonl, samples.jsonl, tensorboard/, logs/
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # checkpoints kept
    # write checkpoints in the background (a forked writer per rank) while training goes on;
    # the next save and the end of the run wait for it. false: every save blocks until written
    async_save: bool = True
    # the distributed optimizer's state in checkpoints: true, gathered over the data-parallel ranks
    # at save (megatron's fully_reshardable: resumes under any layout); false, each rank writes its
    # own shard (dp_reshardable: no gather, far less host and GPU memory at save; a resume may
    # change the data-parallel size only, another tp / pp / ep / etp is refused)
    checkpoint_reshardable: bool = True
    export_every: int = 0  # also write HF weights (model/) into every N-th step's checkpoint (0: only the last step's)
    resume: bool = True  # continue from the run directory's newest checkpoint
    resume_anyway: bool = False  # resume although the config differs from the checkpoint's run
    progress: bool = True  # a progress bar (false: one line per step)
    max_skipped_updates: int = 3  # consecutive NaN/Inf updates before the run stops
    # how long a rank may wait in a collective: the other ranks wait in one while the first
    # rank collects a step's rollouts (DAPO rounds of long samples) or evaluates
    collective_timeout_min: float = 180.0
    # with data.eval_task: evaluate before training, every N steps and at the end (0: only at the end)
    eval_every: int = 0
    # prompts per step whose first sample (prompt, response, rewards, advantage) goes to samples.jsonl and TensorBoard's text tab
    log_samples: int = 4
    flat_reward_steps: int = 3  # warn when every sample got the same rewards this many steps in a row (0: never)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)  # tp, pp, ep, etp, sequence_parallel
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    optim: OptimSettings = field(default_factory=OptimSettings)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def demo_model(self) -> DemoModelSettings:
        """What the built-in model (``model.hf_dir`` unset) is made of: its shape, the
        warm start's data and settings."""
        return DemoModelSettings(self.model, self.warm_start, self.data.max_operand, self.data.held_out)

    def fingerprint(self) -> dict[str, Any]:
        """The settings a resumed run must share with the run that wrote its checkpoints
        (dotted keys -> JSON values): the model, layout, data, rewards, algorithm, replay,
        seed and sampling. Steps, logging, learning rate, the parallel layout (checkpoints
        reshard) and the like may change."""
        flat = _flatten(json.loads(json.dumps(self.to_dict())))
        return {k: v for k, v in flat.items() if k.startswith(_FINGERPRINTED) and k not in _NOT_FINGERPRINTED}


_FINGERPRINTED = (
    "model.",
    "data.",
    "reward.",
    "algorithm.",
    "routing.replay",
    "routing.expert_bias_update_rate",
    "warm_start.",
    "train.seed",
    "rollout.engine",
    "rollout.group_size",
    "rollout.prompts_per_step",
    "rollout.max_new_tokens",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.top_k",
    "rollout.precision",
    "rollout.dynamic_sampling.",
    "rollout.multi_turn.generate_fn",
    "rollout.multi_turn.generate_kwargs",
)
_NOT_FINGERPRINTED = {
    # how the layers are implemented, not what they compute (same parameters; checkpoints read
    # under either: moe_rl.checkpoint.store)
    "model.transformer_impl",
    "model.experts",
    "model.attention",
    "algorithm.micro_batch_size",
    "algorithm.reference",
    "algorithm.max_tokens_per_micro_batch",
    "warm_start.cache_dir",
    "reward.timeout_s",
    "reward.workers",
    "data.eval_task",
    "data.eval_max_prompts",
    "data.eval_samples",
    "data.eval_temperature",
    "data.eval_solved_reward",
}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for every fingerprint entry that differs (a checkpoint's keys
    that have moved since are read at their new place)."""
    saved = {_moved_name(k): v for k, v in saved.items()}
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]


def _moved_name(key: str) -> str:
    """A dotted key (or a key below it) at its present place (``rollout.sglang_urls`` ->
    ``rollout.server.urls``)."""
    section, _, rest = key.partition(".")
    if section != "rollout":
        return key
    for old, new in MOVED_KEYS.items():
        if rest == old or rest.startswith(old + "."):
            return f"rollout.{new}{rest[len(old) :]}"
    return key


# ------------------------------------------------------------------ loading

log = logging.getLogger("moe_rl.config")
_WARNED_MOVED: set[str] = set()  # moved keys this process has warned about


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """YAML file (optional) + ``key.sub=value`` overrides -> validated :class:`Config`."""
    config = parse_config(path, overrides)
    validate(config)
    return config


def parse_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """:func:`load_config` without its semantic checks (files, data, values across sections):
    each key known and of its type, for planning before the model or data exist (``moe-rl
    budget``), which checks what it uses itself."""
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.load(Path(path).read_text(), Loader=ConfigLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path!r} is a directory") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path!r} is not text (YAML)") from None
        except OSError as e:
            raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {yaml_problem(e)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping at the top level")
    _move_keys(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, _, text = item.partition("=")
        try:
            value = _Override(text, yaml.load(text, Loader=ConfigLoader) if text else "")
        except yaml.YAMLError:
            value = _Override(text, text)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node[parts[-1]] = value
    _move_keys(raw)
    config = _build(Config, raw, "")
    # ~/x is the home's, not ./~ (a dataset spec's "~/d.parquet:train" too)
    config.train.run_dir = _home(config.train.run_dir)
    config.model.hf_dir = _home(config.model.hf_dir)
    config.data.task = _home(config.data.task)
    config.data.eval_task = _home(config.data.eval_task)
    return config


@typing.overload
def _home(path: str) -> str: ...
@typing.overload
def _home(path: None) -> None: ...
def _home(path: str | None) -> str | None:
    return os.path.expanduser(path) if path else path


def _move_keys(raw: dict) -> None:
    """Keys that moved into a section (:data:`moe_rl.rollout.settings.MOVED_KEYS`) to their new
    place, with one warning line per key and process (on the first rank)."""
    rollout = raw.get("rollout")
    if not isinstance(rollout, dict):
        return
    for old, new in MOVED_KEYS.items():
        value = rollout.get(old)
        if old not in rollout or isinstance(value.parsed if isinstance(value, _Override) else value, dict):
            continue  # absent, or the section that now stands there (rollout.weight_sync)
        del rollout[old]
        *sections, leaf = new.split(".")
        node = rollout
        for part in sections:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"rollout.{old} moved to rollout.{new}, but rollout.{part} is not a section")
        if leaf in node:
            raise ConfigError(
                f"rollout.{old} and rollout.{new} are both set: rollout.{old} is the old name of rollout.{new}"
            )
        node[leaf] = value
        if old not in _WARNED_MOVED and os.environ.get("RANK", "0") == "0":
            _WARNED_MOVED.add(old)
            log.warning("config: rollout.%s is now rollout.%s (the old key still works)", old, new)


def _build(cls, raw: Any, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        near = difflib.get_close_matches(unknown[0], fields, n=1)
        hint = f" (did you mean '{prefix}{near[0]}'?)" if near else ""
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}'{hint}; valid keys here: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


@dataclass(frozen=True)
class _Override:
    """A command-line value: as written, and as YAML reads it. A string setting takes it as
    written (``data.prompt_template={prompt} Answer:`` is no YAML mapping), others as read."""

    text: str
    parsed: Any


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line, with where it is (``line 2, column 10: expected ',' or ']'``)."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or not problem:
        return str(error).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


class ConfigLoader(yaml.SafeLoader):
    """YAML as the configs are read: PyYAML's safe loader, with YAML 1.2's floats (``1e-7``,
    ``5E3``: text to YAML 1.1, which wants a dot) read as numbers, so that free-form
    mappings need no guessing and a quoted ``"3.10"`` stays text."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _plain(value: Any) -> Any:
    """A free-form mapping's value (``algorithm.loss_params.eps_high=0.28``) as YAML reads it."""
    if isinstance(value, _Override):
        value = value.parsed
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _coerce(tp, value: Any, key: str):
    origin = typing.get_origin(tp)
    if isinstance(value, _Override):
        wants_text = tp is str or (
            origin in (typing.Union, types.UnionType) and str in typing.get_args(tp) and value.parsed is not None
        )
        value = value.parsed if isinstance(value.parsed, str) or not wants_text else value.text
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(inner, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        (inner,) = typing.get_args(tp)
        return [_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, dict) and tp in (bool, int, float, str):  # (rollout.group_size.x=5)
        raise ConfigError(f"{key} is a value, not a section: set it as {key}=VALUE")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    return value


# ------------------------------------------------------------------ validation


def validate(c: Config) -> None:
    """Semantic checks before anything starts (no model, process group or data read): each
    section checks itself; what spans sections is checked here."""
    c.algorithm.validate(c.rollout.group_size)
    c.routing.validate()
    c.rollout.validate()
    if c.rollout.async_rollouts and c.algorithm.old_logprobs != "rollout":
        raise ConfigError(
            "rollout.async_rollouts=true trains on samples of the weights one step behind: set algorithm.old_logprobs=rollout "
            "so that the importance ratio uses the policy that generated them"
        )
    if c.rollout.partial.enabled and c.algorithm.old_logprobs != "rollout":
        raise ConfigError(
            "rollout.partial.enabled=true trains on responses continued across weight updates: set "
            "algorithm.old_logprobs=rollout so that each token's importance ratio uses the weights that drew it"
        )
    if c.rollout.partial.enabled and c.reward.score_as_finished:
        raise ConfigError(
            "rollout.partial.enabled=true scores a step's rewards once its groups are chosen: reward.score_as_finished "
            "does not combine with it yet (set it false)"
        )
    c.reward.validate()
    _validate_multi_turn_rewards(c)
    c.model.validate()
    c.data.validate([r.name for r in c.reward.rewards])
    _validate_warm_start(c.warm_start)
    _validate_training(c)


def _validate_multi_turn_rewards(c: Config) -> None:
    """``overlong_penalty``'s default limit is ``rollout.max_new_tokens``, one turn's: a
    multi-turn transcript's policy tokens over all its turns would pass it untruncated."""
    if not c.rollout.multi_turn.generate_fn:
        return
    for i, item in enumerate(c.reward.rewards):
        if item.fn == "overlong_penalty" and "max_tokens" not in item.kwargs:
            raise ConfigError(
                f"reward.rewards[{i}] (overlong_penalty) needs kwargs.max_tokens under multi-turn rollouts: the "
                "transcript's budget of policy tokens over all its turns (rollout.max_new_tokens limits one turn)"
            )


def _validate_warm_start(w: WarmStartConfig) -> None:
    require_positive("warm_start.steps", w.steps, allow_zero=True)
    require_positive("warm_start.lr", w.lr)
    require_positive("warm_start.batch_size", w.batch_size)


def _validate_training(c: Config) -> None:
    for key in ("tp", "pp", "ep"):
        require_positive(f"parallel.{key}", getattr(c.parallel, key))
    if c.parallel.etp is not None:
        require_positive("parallel.etp", c.parallel.etp)
    try:
        c.optim.validate()
        c.optim.check_horizon(c.train.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = c.train
    require_positive("train.steps", t.steps)
    for key in ("save_every", "export_every", "eval_every", "log_samples", "flat_reward_steps"):
        require_positive(f"train.{key}", getattr(t, key), allow_zero=True)
    for key in ("keep_last", "max_skipped_updates", "collective_timeout_min"):
        require_positive(f"train.{key}", getattr(t, key))
    if not t.run_dir:
        raise ConfigError("train.run_dir is empty")
