"""The ``rollout`` config section: the engine and sampling at its top (the everyday keys), and
a section per concern: ``server`` (SGLang servers, attached or launched), ``weight_sync``,
``multi_turn``, ``dynamic_sampling``, ``simulate_mismatch``. The choice names live here; the
builders in :mod:`moe_rl.experience.builders` read them, each handed its own section."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from moe_rl.checks import ConfigError, require_choice, require_positive

ENGINES = ("local", "sglang")
# how weights reach SGLang servers (moe_rl.rollout.weight_sync): rollout.weight_sync.method
WEIGHT_SYNCS = ("distributed", "tensor", "disk")
# the local engine's weights: as trained, or rounded to a lower precision (torch dtype name)
PRECISIONS = {"fp32": None, "bf16": "bfloat16"}
# how a failed multi-turn sample enters its group's advantages: rollout.multi_turn.failed_samples
FAILED_SAMPLES = ("zero", "drop")


MISMATCH_MODES = ("selection", "weights")  # how the simulated mismatch changes the engine's routing


@dataclass
class SimulatedMismatch:
    """A train-inference mismatch the local engine simulates (:mod:`moe_rl.rollout.mismatch`), on
    the inference side only, in two parts calibrated by the engine after every weight update:
    its routing (a target share of tokens flipped per MoE layer, or a target KL that the flips
    alone cause) and a deterministic perturbation of its final logits (a target KL)."""

    # selection: the experts chosen from perturbed router scores, their gate values from the clean
    # logits (real engines: near-ties flip, gate values barely move); weights: the router weights
    # perturbed, which moves every token's gate values as well as the choice
    mode: str = "selection"
    router_flip_frac: float = 0.0  # per-MoE-layer share of tokens routed to another top-k set (R3 paper: ~0.1 at 30B)
    # instead of router_flip_frac: the KL (per response token) the routing flips alone cause, one
    # noise scale for every layer (the flip fraction is what it takes)
    routing_kl: float = 0.0
    # the KL (per response token) of a deterministic perturbation of the engine's final logits, where
    # it samples and where it reports log-probs: the part no replay removes (R3 paper: ~7.5e-4 under R3)
    logit_kl: float = 0.0
    seed: int = 0  # the perturbation's directions (with train.seed): the same regime for the same seeds

    @property
    def routes(self) -> bool:
        """Whether the engine's routing is perturbed."""
        return self.router_flip_frac > 0 or self.routing_kl > 0

    @property
    def enabled(self) -> bool:
        return self.routes or self.logit_kl > 0

    def validate(self) -> None:
        key = "rollout.simulate_mismatch"
        require_choice(f"{key}.mode", self.mode, MISMATCH_MODES)
        if not 0 <= self.router_flip_frac < 1:
            raise ConfigError(f"{key}.router_flip_frac={self.router_flip_frac} must be in [0, 1) (0: off)")
        for name in ("routing_kl", "logit_kl"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{key}.{name}={getattr(self, name)} must be in [0, 1) (0: off)")
        if self.router_flip_frac > 0 and self.routing_kl > 0:
            raise ConfigError(
                f"{key}.router_flip_frac and {key}.routing_kl both set: the routing is calibrated to one of them"
            )


@dataclass
class ServerConfig:
    """``rollout.server``: the SGLang servers a run attaches to or launches (``rollout.engine=sglang``)."""

    urls: list[str] = field(default_factory=list)  # running SGLang servers to attach to (http://host:port)
    launch: bool = False  # start an SGLang server (else attach to urls)
    port: int = 30000  # a launched server's port
    tp: int = 1  # a launched server's --tp-size
    ep: int = 1  # a launched server's --ep-size
    gpus: list[int] = field(default_factory=list)  # GPUs of a launched server (must not be the trainer's)
    mem_fraction_static: float = 0.8  # a launched server's --mem-fraction-static
    # a launched server: the Python that runs sglang.launch_server ("": this one; SGLang's own
    # venv, e.g. .venv-sglang/bin/python from tools/setup.sh --sglang)
    python: str = ""
    # extra sglang.launch_server flags (after moe-rl's own: they win)
    args: list[str] = field(default_factory=list)
    start_timeout_s: float = 600.0  # how long a launched server may take to become healthy
    # how long one request may wait for its reply (a /generate: queueing plus the whole
    # response, not streamed; a weight update); past it the request is retried, then the run stops
    request_timeout_s: float = 3600.0
    # --enable-deterministic-inference (GPU only: it needs SGLang's CUDA kernels): batch-invariant
    # kernels and the pytorch sampling backend, slower; on to reproduce a rollout exactly
    deterministic: bool = False
    # /generate requests in flight per server (the client's connection pool holds this many per
    # server; a prompt's samples go to one server, which then reuses their prompt's KV cache)
    concurrency: int = 64

    def validate(self, engine: str) -> None:
        if engine == "sglang" and not self.urls and not self.launch:
            raise ConfigError("rollout.engine=sglang needs rollout.server.urls or rollout.server.launch=true")
        for i, url in enumerate(self.urls):
            if not is_server_url(url):
                raise ConfigError(f"rollout.server.urls[{i}]={url!r} must be a URL like http://host:30000")
        if any(g < 0 for g in self.gpus) or len(set(self.gpus)) != len(self.gpus):
            raise ConfigError(f"rollout.server.gpus={self.gpus} must be distinct GPU ids >= 0")
        if self.gpus and len(self.gpus) < self.tp:
            raise ConfigError(f"rollout.server.gpus={self.gpus} has fewer GPUs than rollout.server.tp={self.tp}")
        python = os.path.expanduser(self.python)
        if self.launch and self.python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ConfigError(
                f"rollout.server.python={self.python!r} is not an executable file (SGLang's Python: bash tools/setup.sh --sglang makes .venv-sglang/bin/python)"
            )
        for key in ("start_timeout_s", "request_timeout_s", "concurrency", "tp", "ep"):
            require_positive(f"rollout.server.{key}", getattr(self, key))
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"rollout.server.port={self.port} must be in [1, 65535]")
        if not 0 < self.mem_fraction_static <= 1:
            raise ConfigError(f"rollout.server.mem_fraction_static={self.mem_fraction_static} must be in (0, 1]")


@dataclass
class WeightSyncConfig:
    """``rollout.weight_sync``: how the trained weights reach SGLang servers after each step
    (the local engine is always synced in process)."""

    # distributed (buckets broadcast over a weight-update group the servers join) | disk (a HF
    # directory each server re-reads) | tensor (by reference: CUDA IPC handles, servers on the
    # first rank's node only)
    method: str = "distributed"
    # distributed | tensor: a bucket's size (MiB), the most full tensors a sending rank holds at
    # once; one flat tensor each where the servers take that (SGLang >= 0.5.6; else one per
    # tensor); distributed: sent by the first rank of its pipeline stage
    bucket_mb: float = 512.0
    # distributed: the first trainer rank's address as servers reach it ("": found; the other
    # pipeline stages' senders always find theirs)
    address: str = ""

    def validate(self) -> None:
        require_choice("rollout.weight_sync.method", self.method, WEIGHT_SYNCS)
        require_positive("rollout.weight_sync.bucket_mb", self.bucket_mb)


@dataclass
class MultiTurnConfig:
    """``rollout.multi_turn``: multi-turn / tool-use rollouts through the user's generate function."""

    # "package.module:function", an async generate function (moe_rl.rollout.multi_turn; "": one
    # engine call per sample)
    generate_fn: str = ""
    generate_kwargs: dict = field(default_factory=dict)  # keyword arguments of rollout.multi_turn.generate_fn
    # a sample's generate function that spends more than this outside the engine's turns (its own code
    # and its environment's; a turn waiting for the engine does not count) scores 0: cancelled at its
    # next await (abandoned 1 s later if it ignores that); one that blocks the event loop cannot be
    # stopped, only named in a warning
    timeout_s: float = 300.0
    # a step with more than this share of its samples failed stops the run, in one line naming the
    # first reason (1: only a step in which every sample failed, which always stops)
    max_failed_frac: float = 1.0
    # how a failed sample (scored 0 in every reward, none of its tokens trained) enters its group's
    # advantages: zero (a reward of 0 in the group's statistics) | drop (left out of them: the
    # statistics over the group's other samples, its own advantage 0)
    failed_samples: str = "zero"

    def validate(self) -> None:
        require_positive("rollout.multi_turn.timeout_s", self.timeout_s)
        require_choice("rollout.multi_turn.failed_samples", self.failed_samples, FAILED_SAMPLES)
        if not 0 <= self.max_failed_frac <= 1:
            raise ConfigError(f"rollout.multi_turn.max_failed_frac={self.max_failed_frac} must be in [0, 1]")
        if self.generate_fn:
            from moe_rl.rollout.multi_turn import check_generate_fn

            try:
                check_generate_fn(self.generate_fn, dict(self.generate_kwargs))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.generate_kwargs:
            raise ConfigError(
                "rollout.multi_turn.generate_kwargs are the arguments of rollout.multi_turn.generate_fn, which is not set"
            )


@dataclass
class DynamicSamplingConfig:
    """``rollout.dynamic_sampling``: DAPO's dynamic sampling."""

    # drop groups whose samples all got the same rewards (zero advantage) and sample more
    # prompts, up to max_rounds rounds per step
    enabled: bool = False
    max_rounds: int = 3  # generation rounds per step at most

    def validate(self) -> None:
        require_positive("rollout.dynamic_sampling.max_rounds", self.max_rounds)


@dataclass
class PartialConfig:
    """``rollout.partial``: partial rollouts (:mod:`moe_rl.rollout.partial`, single-turn)."""

    # a step's generation ends once rollout.prompts_per_step groups are done; the responses still
    # running are stopped with their tokens and continued in the next step, after the weight update
    enabled: bool = False
    # groups generated beyond prompts_per_step (new prompts while fewer are carried over): the
    # longest responses then no longer hold up a step
    extra_groups: int = 4

    def validate(self) -> None:
        require_positive("rollout.partial.extra_groups", self.extra_groups, allow_zero=True)


# keys that moved into a section (rollout.KEY -> rollout.NEW.PLACE): they keep working, with one warning
MOVED_KEYS = {
    "sglang_urls": "server.urls",
    "launch_server": "server.launch",
    "server_port": "server.port",
    "server_tp": "server.tp",
    "server_ep": "server.ep",
    "server_gpus": "server.gpus",
    "mem_fraction_static": "server.mem_fraction_static",
    "server_python": "server.python",
    "server_args": "server.args",
    "server_start_timeout_s": "server.start_timeout_s",
    "server_deterministic": "server.deterministic",
    "concurrency_per_server": "server.concurrency",
    "weight_sync": "weight_sync.method",  # a value that is not a mapping: the method
    "sync_bucket_mb": "weight_sync.bucket_mb",
    "sync_address": "weight_sync.address",
    "generate_fn": "multi_turn.generate_fn",
    "generate_kwargs": "multi_turn.generate_kwargs",
    "generate_timeout_s": "multi_turn.timeout_s",
    "max_failed_frac": "multi_turn.max_failed_frac",
    "failed_samples": "multi_turn.failed_samples",
    "filter_zero_std_groups": "dynamic_sampling.enabled",
    "max_sampling_rounds": "dynamic_sampling.max_rounds",
}


@dataclass
class RolloutConfig:
    engine: str = "local"  # local | sglang
    group_size: int = 8  # responses per prompt (a GRPO group)
    prompts_per_step: int = 16  # prompts per step (the batch is prompts_per_step x group_size)
    max_new_tokens: int = 6  # response length limit (6 suits the built-in a+b= task; raise it for real data)
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use it too)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # -1: off
    precision: str = "fp32"  # local engine: fp32 | bf16 (round weights to bf16, compute fp32)
    # SGLang servers on the trainer's GPUs (started with --enable-memory-saver): each side
    # releases its GPU memory while the other works (trainer state offloaded to host memory)
    colocate: bool = False
    # generate step k+1's samples while step k trains (one version behind; needs
    # algorithm.old_logprobs=rollout so the importance ratio uses the behaviour policy)
    async_rollouts: bool = False
    server: ServerConfig = field(default_factory=ServerConfig)  # SGLang servers
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # weights into SGLang servers
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # multi-turn / tool-use rollouts
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)  # DAPO's
    # local engine: a simulated train-inference mismatch (routers perturbed on the inference side)
    simulate_mismatch: SimulatedMismatch = field(default_factory=SimulatedMismatch)
    partial: PartialConfig = field(default_factory=PartialConfig)  # partial rollouts
    # partial rollouts: the most weight versions a trained token may be behind the weights it
    # trains (older carried responses start over); async rollouts alone are always 1 behind
    max_staleness: int = 2

    def validate(self) -> None:
        require_choice("rollout.engine", self.engine, ENGINES)
        self.simulate_mismatch.validate()
        if self.simulate_mismatch.enabled and self.engine != "local":
            raise ConfigError(
                "rollout.simulate_mismatch applies to the local engine only (rollout.engine=local): a real server has its own"
            )
        require_choice("rollout.precision", self.precision, PRECISIONS)
        if self.precision != "fp32" and self.engine != "local":
            raise ConfigError("rollout.precision applies to the local engine only (rollout.engine=local)")
        self.server.validate(self.engine)
        self.weight_sync.validate()
        self.multi_turn.validate()
        self.dynamic_sampling.validate()
        self.partial.validate()
        self._validate_placement()
        self._validate_partial()
        for key in ("group_size", "prompts_per_step", "max_new_tokens", "temperature"):
            require_positive(f"rollout.{key}", getattr(self, key))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"rollout.top_k={self.top_k} must be -1 (off) or >= 1")

    def _validate_partial(self) -> None:
        if not self.partial.enabled:
            return
        least = 2 if self.async_rollouts else 1
        if self.max_staleness < least:
            raise ConfigError(
                f"rollout.max_staleness={self.max_staleness}: with rollout.partial.enabled=true a continued response's "
                f"first tokens are {least} version(s) behind the weights it trains{' (async rollouts)' if least > 1 else ''}; "
                f"set it to {least} or more"
            )
        for what, on in (
            ("rollout.multi_turn.generate_fn", bool(self.multi_turn.generate_fn)),
            ("rollout.dynamic_sampling.enabled=true", self.dynamic_sampling.enabled),
        ):
            if on:
                raise ConfigError(f"rollout.partial.enabled=true does not combine with {what} (not supported yet)")

    def _validate_placement(self) -> None:
        if self.colocate and self.engine != "sglang":
            raise ConfigError(
                "rollout.colocate=true shares the trainer's GPUs with SGLang servers: it needs rollout.engine=sglang"
            )
        if self.colocate and self.async_rollouts:
            raise ConfigError(
                "rollout.colocate=true and rollout.async_rollouts=true exclude each other: colocated rollouts and training take turns on the same GPUs"
            )
        if self.colocate and self.weight_sync.method == "distributed":
            raise ConfigError(
                "rollout.colocate=true needs rollout.weight_sync.method=tensor (or disk): the distributed sync puts "
                "the trainer's first rank and a server's rank in one NCCL group on the same GPU, which NCCL refuses"
            )


def is_server_url(url: str) -> bool:
    """Whether ``url`` is an http(s) URL with a host (a server's, e.g. http://host:30000)."""
    return url.startswith(("http://", "https://")) and len(url.split("://", 1)[1].strip("/")) > 0
