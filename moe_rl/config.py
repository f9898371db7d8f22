"""The run configuration: a typed tree of dataclasses, read from YAML, with dotted
command-line overrides (``algorithm.loss=gspo``), validated before anything starts.
Every error names the key, the value and what would be valid."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


# families the built-in model can be made of
DEMO_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "glm4_moe", "deepseek_v3")
# how routed experts are built (moe_rl.models.layers.decoder_block_spec)
EXPERT_MODULES = ("grouped", "sequential")
ATTENTION_MODULES = ("sdpa", "local")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@dataclass
class ModelConfig:
    hf_dir: str | None = None  # None: the built-in tiny demo model (warm-started and cached)
    architecture: str = "qwen3_moe"  # for the built-in model: one of DEMO_ARCHITECTURES
    hidden_size: int = 64  # the built-in model: hidden width
    num_layers: int = 2  # the built-in model: decoder layers (all MoE)
    num_experts: int = 8  # the built-in model: routed experts per layer
    top_k: int = 2  # the built-in model: experts per token
    # routed experts: grouped (stacked weights, a grouped matmul per projection) or sequential
    # (megatron-core's SequentialMLP, one module per expert); checkpoints are the same HF tensors
    experts: str = "grouped"
    # core attention: sdpa (torch's fused scaled_dot_product_attention) or local (megatron's,
    # which keeps [batch x heads, s, s] scores per layer)
    attention: str = "sdpa"
    # linear layers and core attention: local (torch), transformer_engine (Transformer Engine's
    # linears and fused attention, with its fused RoPE and token permutation; the same
    # weights, norms and experts module) or auto (transformer_engine where it imports and a
    # GPU is present, else local)
    transformer_impl: str = "auto"


@dataclass
class DataConfig:
    # a built-in task (arithmetic | arithmetic_chain), or a dataset: .jsonl/.json/.parquet file, datasets dir (DIR[:split])
    task: str = "arithmetic"
    prompt_key: str = "prompt"  # a dataset's prompt field (dots reach nested fields); text or chat messages
    answer_key: str = "answer"  # its reference-answer field, e.g. reward_model.ground_truth
    prompt_template: str = "{prompt}"  # wraps the question, e.g. "{prompt} Put the answer in \\boxed{}."
    chat_template: bool = False  # apply the tokenizer's chat template (with the generation prompt)
    system_prompt: str = ""  # with chat_template: a system message before each prompt
    max_operand: int = 9  # the built-in tasks: largest operand
    max_prompt_tokens: int = 64  # longer prompts are left-truncated (counted)
    eval_task: str | None = None  # held-out problems (same forms as task); evaluated every train.eval_every steps
    eval_max_prompts: int = 0  # 0: every problem (the built-in task: 64)
    eval_samples: int = 4  # responses per prompt: pass@1 and pass@<eval_samples>
    eval_temperature: float = 1.0  # sampling temperature of the evaluation
    eval_solved_reward: str = "correct"  # a reward: a response solves its problem when it scores >= 1


@dataclass
class RolloutConfig:
    engine: str = "local"  # local | sglang
    group_size: int = 8  # responses per prompt (a GRPO group)
    prompts_per_step: int = 16  # prompts per step (the batch is prompts_per_step x group_size)
    max_new_tokens: int = 6  # response length limit (6 suits the built-in a+b= task; raise it for real data)
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use it too)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # -1: off
    sglang_urls: list[str] = field(default_factory=list)  # running SGLang servers to attach to (http://host:port)
    launch_server: bool = False  # start SGLang servers (else attach to sglang_urls)
    server_port: int = 30000  # a launched server's port
    server_tp: int = 1  # a launched server's --tp-size
    server_ep: int = 1  # a launched server's --ep-size
    server_gpus: list[int] = field(default_factory=list)  # GPUs of a launched server (must not be the trainer's)
    mem_fraction_static: float = 0.8  # a launched server's --mem-fraction-static
    # a launched server: the Python that runs sglang.launch_server ("": this one; SGLang's own
    # venv, e.g. .venv-sglang/bin/python from tools/setup.sh --sglang), extra launch flags
    # (after moe-rl's own: a flag given here wins), how long it may take to become healthy
    server_python: str = ""
    # extra sglang.launch_server flags (after moe-rl's own: they win)
    server_args: list[str] = field(default_factory=list)
    server_start_timeout_s: float = 600.0  # how long a launched server may take to become healthy
    # --enable-deterministic-inference (GPU only: it needs SGLang's CUDA kernels): batch-invariant
    # kernels and the pytorch sampling backend, slower; on to reproduce a rollout exactly
    server_deterministic: bool = False
    precision: str = "fp32"  # local engine: fp32 | bf16 (round weights to bf16, compute fp32)
    # SGLang: how weights reach the servers after each step: distributed (buckets broadcast
    # over a weight-update group the servers join) | disk (a HF directory each server re-reads)
    # | tensor (by reference: CUDA IPC handles, servers on the first rank's node only)
    weight_sync: str = "distributed"
    # SGLang servers on the trainer's GPUs (started with --enable-memory-saver): each side
    # releases its GPU memory while the other works (trainer state offloaded to host memory)
    colocate: bool = False
    # distributed | tensor: a bucket's size (MiB), the most full tensors a sending rank holds at
    # once; one flat tensor each where the servers take that (SGLang >= 0.5.6; else one per
    # tensor); distributed: sent by the first rank of its pipeline stage
    sync_bucket_mb: float = 512.0
    # distributed: the first trainer rank's address as servers reach it ("": found; the other
    # pipeline stages' senders always find theirs)
    sync_address: str = ""
    # SGLang: /generate requests in flight per server (the client's connection pool holds this
    # many per server; a prompt's samples go to one server, which then reuses their prompt's KV cache)
    concurrency_per_server: int = 64
    # generate step k+1's samples while step k trains (one version behind; needs
    # algorithm.old_logprobs=rollout so the importance ratio uses the behaviour policy)
    async_rollouts: bool = False
    # DAPO dynamic sampling: drop groups whose samples all got the same rewards (zero
    # advantage) and sample more prompts, up to max_sampling_rounds rounds per step
    filter_zero_std_groups: bool = False
    max_sampling_rounds: int = 3  # dynamic sampling: generation rounds per step at most
    # multi-turn / tool-use rollouts: "package.module:function", an async generate function
    # (moe_rl.rollout.multi_turn; "" = one engine call per sample), the keyword arguments it
    # gets, and how long one sample's function may run before it scores 0
    generate_fn: str = ""
    generate_kwargs: dict = field(default_factory=dict)  # keyword arguments of rollout.generate_fn
    generate_timeout_s: float = 300.0  # one sample's generate function may run this long before it scores 0


@dataclass
class RewardItem:
    name: str = ""
    fn: str = ""
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)


@dataclass
class ConditionalItem:
    target: str = ""
    condition: str = ""
    threshold: float = 1.0


@dataclass
class RewardConfig:
    # named rewards (fn: a built-in rule or module:function), summed with their weights
    # (GDPO: normalised apart); the defaults suit the built-in a+b= task
    rewards: list[RewardItem] = field(
        default_factory=lambda: [
            RewardItem("correct", "math_correct", 1.0),
            RewardItem("format", "format", 0.5),
            RewardItem("short", "length", 0.25, {"budget": 4}),
        ]
    )
    # target pays only where condition >= threshold
    conditionals: list[ConditionalItem] = field(default_factory=lambda: [ConditionalItem("short", "correct", 1.0)])
    timeout_s: float = 5.0  # a reward call past this scores 0 (counted in reward/failures/<name>)
    # 0: each call in a thread of the first rank, one at a time; N: N worker processes in
    # parallel, a call past timeout_s has its worker killed (nothing left running)
    workers: int = 0


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | gdpo (moe_rl.algorithms.advantages)
    loss: str = "grpo"  # grpo | gspo | gspo_token | gmpo | gmpo_seqclip | cispo | sapo (moe_rl.algorithms.losses)
    loss_params: dict = field(default_factory=dict)  # the loss's parameters, e.g. {eps_low: 0.2, eps_high: 0.28}
    old_logprobs: str = "recompute"  # recompute | rollout (the engine's: the mismatch folded into the ratio)
    # train-inference mismatch correction (moe_rl.algorithms.rollout_correction): none |
    # token_tis | seq_tis | token_mis | icepop | seq_mis | reject, with its parameters
    rollout_correction: str = "none"
    rollout_correction_params: dict = field(default_factory=dict)  # its parameters, e.g. {upper: 2.0}
    kl_coef: float = 0.0  # KL to the reference (starting) policy; 0: off
    reference: str = "host"  # KL reference: host (starting weights swapped into the policy) | device (a second model)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0  # entropy bonus
    updates_per_batch: int = 2  # optimizer steps on each step's samples
    micro_batch_size: int = 32  # rows per micro-batch (with a token budget: at most)
    # samples packed by length into micro-batches of at most this many padded tokens (rows x
    # longest), data-parallel ranks balanced by tokens; -1: derived each step, micro_batch_size
    # x the step's mean sample length; 0: micro_batch_size rows in sample order. Every
    # micro-batch is padded only to its own longest sample
    max_tokens_per_micro_batch: int = -1

    @property
    def corrects_rollout(self) -> bool:
        """Whether a rollout correction weighs (and may drop) tokens."""
        return self.rollout_correction != "none"


@dataclass
class RoutingConfig:
    replay: str = "none"  # none | r2 | r3
    # routers with an expert bias (GLM-4.5, DeepSeek-V3): aux-loss-free balancing step; 0 freezes it
    expert_bias_update_rate: float = 1e-3
    metrics: bool = True  # drift metrics; also asks the rollout engine for routed experts (train-inference drift)
    # one extra forward to measure the routing an update changes (and router_kl, the only metric that keeps router distributions)
    after_update_pass: bool = True
    # share of each micro-batch's tokens the drift metrics observe (a seeded draw; counts scaled to all tokens): < 1 for huge batches
    metrics_sample_frac: float = 1.0
    recompute_activations: bool = False  # recompute MoE layers in the backward (R2/R3 replay the same routing there)


@dataclass
class WarmStartConfig:
    steps: int = 100  # the built-in model's supervised warm start: steps
    lr: float = 3e-3  # its learning rate
    batch_size: int = 64  # its batch size
    cache_dir: str = "~/.cache/moe-rl"  # where the warm-started model is cached (keyed by the settings that shape it)


@dataclass
class TrainConfig:
    steps: int = 30  # RL steps
    seed: int = 1  # data order, sampling seeds, initial weights of the built-in model
    run_dir: str = "runs/default"  # checkpoints, metrics.jsonl, samples.jsonl, tensorboard/, logs/
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # checkpoints kept
    # write checkpoints in the background (a forked writer per rank) while training goes on;
    # the next save and the end of the run wait for it. false: every save blocks until written
    async_save: bool = True
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
    "rollout.filter_zero_std_groups",
    "rollout.max_sampling_rounds",
    "rollout.generate_fn",
    "rollout.generate_kwargs",
)
_NOT_FINGERPRINTED = {
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
    """``key: saved -> current`` for every fingerprint entry that differs."""
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]


# ------------------------------------------------------------------ loading


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """YAML file (optional) + ``key.sub=value`` overrides -> validated :class:`Config`."""
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path!r} is a directory") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path!r} is not text (YAML)") from None
        except OSError as e:
            raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, _, text = item.partition("=")
        try:
            value = _Override(text, yaml.safe_load(text) if text else "")
        except yaml.YAMLError:
            value = _Override(text, text)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node[parts[-1]] = value
    config = _build(Config, raw, "")
    validate(config)
    return config


def _build(cls, raw: Any, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}'; valid keys here: {', '.join(sorted(fields))}")
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


def _plain(value: Any) -> Any:
    """A free-form mapping's value (``algorithm.loss_params.eps_high=0.28``): as YAML reads
    it, with a number YAML leaves as text (``1e-7``) made a number."""
    if isinstance(value, _Override):
        value = value.parsed
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
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


def _choice(key: str, value: Any, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(map(str, valid))}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def validate(c: Config) -> None:
    """Semantic checks before anything starts (no model, process group or data read)."""
    _validate_algorithm(c.algorithm, c.rollout.group_size)
    _validate_rollout(c.rollout, c.routing)
    if c.rollout.async_rollouts and c.algorithm.old_logprobs != "rollout":
        raise ConfigError(
            "rollout.async_rollouts=true trains on samples of the weights one step behind: set algorithm.old_logprobs=rollout "
            "so that the importance ratio uses the policy that generated them"
        )
    _validate_rewards(c.reward)
    _validate_model_and_data(c)
    _validate_training(c)


def _validate_algorithm(a: AlgorithmConfig, group_size: int) -> None:
    from moe_rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
    from moe_rl.algorithms.losses import check_loss_params

    _choice("algorithm.advantage", a.advantage, ADVANTAGE_ESTIMATORS.names())
    _choice("algorithm.loss", a.loss, POLICY_LOSSES.names())
    try:
        check_loss_params(a.loss, a.loss_params, configurable_only=True)
    except ValueError as e:
        raise ConfigError(f"algorithm.loss_params.{e}") from None
    _choice("algorithm.old_logprobs", a.old_logprobs, ("recompute", "rollout"))
    _validate_rollout_correction(a)
    _choice("algorithm.reference", a.reference, ("host", "device"))
    _choice("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS.names())
    _positive("algorithm.kl_coef", a.kl_coef, allow_zero=True)
    _positive("algorithm.entropy_coef", a.entropy_coef, allow_zero=True)
    _positive("algorithm.updates_per_batch", a.updates_per_batch)
    _positive("algorithm.micro_batch_size", a.micro_batch_size)
    if a.max_tokens_per_micro_batch < -1:
        raise ConfigError(
            f"algorithm.max_tokens_per_micro_batch={a.max_tokens_per_micro_batch} must be -1 (derived), 0 (by rows) or a token budget > 0"
        )
    if a.advantage != "dr_grpo" and group_size < 2:
        raise ConfigError(f"rollout.group_size={group_size} must be >= 2 for algorithm.advantage={a.advantage!r}")


def _validate_rollout_correction(a: AlgorithmConfig) -> None:
    from moe_rl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, check_correction_params

    _choice("algorithm.rollout_correction", a.rollout_correction, ["none", *ROLLOUT_CORRECTIONS.names()])
    if not a.corrects_rollout:
        if a.rollout_correction_params:
            raise ConfigError("algorithm.rollout_correction_params are set but algorithm.rollout_correction is none")
        return
    if a.old_logprobs == "rollout":
        raise ConfigError(
            f"algorithm.rollout_correction={a.rollout_correction!r} weighs the trainer's recomputed old log-probs "
            "against the engine's; with algorithm.old_logprobs=rollout the ratio is already taken against the "
            "engine's (the correction is folded in): use one or the other"
        )
    try:
        check_correction_params(a.rollout_correction, a.rollout_correction_params)
    except ValueError as e:
        raise ConfigError(f"algorithm.rollout_correction_params.{e}") from None


def _validate_rollout(r: RolloutConfig, routing: RoutingConfig) -> None:
    from moe_rl.routing.modes import REPLAY_MODES

    _choice("routing.replay", routing.replay, REPLAY_MODES)
    _positive("routing.expert_bias_update_rate", routing.expert_bias_update_rate, allow_zero=True)
    if not 0 < routing.metrics_sample_frac <= 1:
        raise ConfigError(f"routing.metrics_sample_frac={routing.metrics_sample_frac} must be in (0, 1]")
    _choice("rollout.engine", r.engine, ("local", "sglang"))
    _choice("rollout.precision", r.precision, ("fp32", "bf16"))
    if r.engine == "sglang" and not r.sglang_urls and not r.launch_server:
        raise ConfigError("rollout.engine=sglang needs rollout.sglang_urls or rollout.launch_server=true")
    for i, url in enumerate(r.sglang_urls):
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
            raise ConfigError(f"rollout.sglang_urls[{i}]={url!r} must be a URL like http://host:30000")
    if r.precision != "fp32" and r.engine != "local":
        raise ConfigError("rollout.precision applies to the local engine only (rollout.engine=local)")
    if any(g < 0 for g in r.server_gpus) or len(set(r.server_gpus)) != len(r.server_gpus):
        raise ConfigError(f"rollout.server_gpus={r.server_gpus} must be distinct GPU ids >= 0")
    _choice("rollout.weight_sync", r.weight_sync, ("distributed", "tensor", "disk"))
    if r.colocate and r.engine != "sglang":
        raise ConfigError(
            "rollout.colocate=true shares the trainer's GPUs with SGLang servers: it needs rollout.engine=sglang"
        )
    if r.colocate and r.async_rollouts:
        raise ConfigError(
            "rollout.colocate=true and rollout.async_rollouts=true exclude each other: colocated rollouts and training take turns on the same GPUs"
        )
    for key in (
        "sync_bucket_mb",
        "concurrency_per_server",
        "server_tp",
        "server_ep",
        "group_size",
        "prompts_per_step",
        "max_new_tokens",
        "temperature",
        "max_sampling_rounds",
    ):
        _positive(f"rollout.{key}", getattr(r, key))
    if r.server_gpus and len(r.server_gpus) < r.server_tp:
        raise ConfigError(f"rollout.server_gpus={r.server_gpus} has fewer GPUs than rollout.server_tp={r.server_tp}")
    if r.launch_server and r.server_python and not os.access(os.path.expanduser(r.server_python), os.X_OK):
        raise ConfigError(
            f"rollout.server_python={r.server_python!r} is not an executable (SGLang's Python: bash tools/setup.sh --sglang makes .venv-sglang/bin/python)"
        )
    _positive("rollout.server_start_timeout_s", r.server_start_timeout_s)
    if not 1 <= r.server_port <= 65535:
        raise ConfigError(f"rollout.server_port={r.server_port} must be in [1, 65535]")
    if not 0 < r.mem_fraction_static <= 1:
        raise ConfigError(f"rollout.mem_fraction_static={r.mem_fraction_static} must be in (0, 1]")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.top_k == 0 or r.top_k < -1:
        raise ConfigError(f"rollout.top_k={r.top_k} must be -1 (off) or >= 1")
    _positive("rollout.generate_timeout_s", r.generate_timeout_s)
    if r.generate_fn:
        from moe_rl.rollout.multi_turn import check_generate_fn

        try:
            check_generate_fn(r.generate_fn, dict(r.generate_kwargs))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif r.generate_kwargs:
        raise ConfigError("rollout.generate_kwargs are the arguments of rollout.generate_fn, which is not set")


def _validate_rewards(reward: RewardConfig) -> None:
    from moe_rl.rewards import check_reward_function

    names = [item.name for item in reward.rewards]
    if not names:
        raise ConfigError("reward.rewards is empty; give at least one reward")
    for i, item in enumerate(reward.rewards):
        if not item.name:
            raise ConfigError(f"reward.rewards[{i}].name is empty")
        try:
            check_reward_function(item.fn, item.kwargs)
        except ValueError as e:
            raise ConfigError(f"reward.rewards[{i}].fn={item.fn!r} {e}") from None
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.rewards names must be unique, got {names}")
    for i, cond in enumerate(reward.conditionals):
        for attr in ("target", "condition"):
            if getattr(cond, attr) not in names:
                raise ConfigError(
                    f"reward.conditionals[{i}].{attr}={getattr(cond, attr)!r} is not a reward; rewards: {', '.join(names)}"
                )
    _positive("reward.timeout_s", reward.timeout_s)
    _positive("reward.workers", reward.workers, allow_zero=True)


def _validate_model_and_data(c: Config) -> None:
    m = c.model
    _choice("model.experts", m.experts, EXPERT_MODULES)
    _choice("model.attention", m.attention, ATTENTION_MODULES)
    _choice("model.transformer_impl", m.transformer_impl, TRANSFORMER_IMPLS)
    if m.transformer_impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(
            "model.transformer_impl=transformer_engine, but Transformer Engine is not installed (model.transformer_impl=auto or local)"
        )
    if m.hf_dir is not None:
        _check_hf_dir(m.hf_dir)
    else:
        _choice("model.architecture", m.architecture, DEMO_ARCHITECTURES)
        for key in ("hidden_size", "num_layers", "num_experts", "top_k"):
            _positive(f"model.{key}", getattr(m, key))
        if m.hidden_size % 4:
            raise ConfigError(
                f"model.hidden_size={m.hidden_size} must be a multiple of 4 (the built-in model has 4 heads)"
            )
        if m.top_k > m.num_experts:
            raise ConfigError(f"model.top_k={m.top_k} exceeds model.num_experts={m.num_experts}")
    _validate_data(c.data, [r.name for r in c.reward.rewards])
    w = c.warm_start
    _positive("warm_start.steps", w.steps, allow_zero=True)
    _positive("warm_start.lr", w.lr)
    _positive("warm_start.batch_size", w.batch_size)


def _validate_data(d: DataConfig, reward_names: list[str]) -> None:
    from moe_rl.data.prompts import check_prompt_settings
    from moe_rl.data.tasks import BUILT_IN_TASKS, resolve_spec

    for key in ("task", "eval_task"):
        spec = getattr(d, key)
        if spec is not None and spec not in BUILT_IN_TASKS:
            try:
                resolve_spec(spec)
            except ValueError as e:
                raise ConfigError(f"data.{key}={e}") from None
    try:
        check_prompt_settings(d.prompt_template, d.system_prompt, d.chat_template)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _positive("data.max_operand", d.max_operand, allow_zero=True)
    _positive("data.max_prompt_tokens", d.max_prompt_tokens)
    _positive("data.eval_max_prompts", d.eval_max_prompts, allow_zero=True)
    _positive("data.eval_samples", d.eval_samples)
    _positive("data.eval_temperature", d.eval_temperature)
    if d.eval_task is not None and d.eval_solved_reward not in reward_names:
        raise ConfigError(
            f"data.eval_solved_reward={d.eval_solved_reward!r} is not a reward; rewards: {', '.join(reward_names)}"
        )


def _check_hf_dir(hf_dir: str) -> None:
    from moe_rl.models.architectures import ARCHITECTURES

    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.hf_dir={hf_dir!r} has no config.json (a local Hugging Face model directory is needed)"
        )
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"model.hf_dir={hf_dir!r}: config.json is not readable JSON ({type(e).__name__})") from None
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"model.hf_dir={hf_dir!r} has model_type={model_type!r}; supported: {', '.join(ARCHITECTURES.names())}"
        )
    from moe_rl.models.architectures import load_hf_config, unsupported_setting

    try:
        problem = unsupported_setting(load_hf_config(hf_dir))
    except ValueError as e:
        raise ConfigError(f"model.hf_dir={hf_dir!r}: {e}") from None
    if problem:
        raise ConfigError(f"model.hf_dir={hf_dir!r} ({model_type}): {problem} is not supported")


def _validate_training(c: Config) -> None:
    for key in ("tp", "pp", "ep"):
        _positive(f"parallel.{key}", getattr(c.parallel, key))
    if c.parallel.etp is not None:
        _positive("parallel.etp", c.parallel.etp)
    try:
        c.optim.validate()
        c.optim.check_horizon(c.train.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _positive("train.steps", c.train.steps)
    _positive("train.save_every", c.train.save_every, allow_zero=True)
    _positive("train.keep_last", c.train.keep_last)
    _positive("train.export_every", c.train.export_every, allow_zero=True)
    _positive("train.max_skipped_updates", c.train.max_skipped_updates)
    _positive("train.collective_timeout_min", c.train.collective_timeout_min)
    _positive("train.eval_every", c.train.eval_every, allow_zero=True)
    _positive("train.log_samples", c.train.log_samples, allow_zero=True)
    _positive("train.flat_reward_steps", c.train.flat_reward_steps, allow_zero=True)
    if not c.train.run_dir:
        raise ConfigError("train.run_dir is empty")
