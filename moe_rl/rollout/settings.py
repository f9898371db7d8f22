"""The ``rollout`` config section: the engine, sampling, SGLang servers (attached or launched),
weight sync, asynchronous and multi-turn rollouts. The choice names live here; the builders
in :mod:`moe_rl.experience.builders` read them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from moe_rl.checks import ConfigError, require_choice, require_positive

ENGINES = ("local", "sglang")
# how weights reach SGLang servers (moe_rl.rollout.weight_sync)
WEIGHT_SYNCS = ("distributed", "tensor", "disk")
# the local engine's weights: as trained, or rounded to a lower precision (torch dtype name)
PRECISIONS = {"fp32": None, "bf16": "bfloat16"}
# how a failed multi-turn sample enters its group's advantages (moe_rl.experience.failed_samples)
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
    # a sample's generate function past this scores 0: cancelled at its next await (abandoned 1 s later
    # if it ignores that); one that blocks the event loop cannot be stopped, only named in a warning
    generate_timeout_s: float = 300.0
    # multi-turn: a step with more than this share of its samples failed stops the run, in one
    # line naming the first reason (1: only a step in which every sample failed, which always stops)
    max_failed_frac: float = 1.0
    # multi-turn: how a failed sample (scored 0 in every reward, none of its tokens trained)
    # enters its group's advantages: zero (a reward of 0 in the group's statistics) | drop (left
    # out of them: the statistics over the group's other samples, its own advantage 0)
    failed_samples: str = "zero"
    # local engine: a simulated train-inference mismatch (routers perturbed on the inference side)
    simulate_mismatch: SimulatedMismatch = field(default_factory=SimulatedMismatch)

    def validate(self) -> None:
        require_choice("rollout.engine", self.engine, ENGINES)
        self.simulate_mismatch.validate()
        if self.simulate_mismatch.enabled and self.engine != "local":
            raise ConfigError(
                "rollout.simulate_mismatch applies to the local engine only (rollout.engine=local): a real server has its own"
            )
        require_choice("rollout.precision", self.precision, PRECISIONS)
        require_choice("rollout.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        self._validate_servers()
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
            require_positive(f"rollout.{key}", getattr(self, key))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"rollout.top_k={self.top_k} must be -1 (off) or >= 1")
        self._validate_generate_fn()

    def _validate_servers(self) -> None:
        if self.engine == "sglang" and not self.sglang_urls and not self.launch_server:
            raise ConfigError("rollout.engine=sglang needs rollout.sglang_urls or rollout.launch_server=true")
        for i, url in enumerate(self.sglang_urls):
            if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
                raise ConfigError(f"rollout.sglang_urls[{i}]={url!r} must be a URL like http://host:30000")
        if self.precision != "fp32" and self.engine != "local":
            raise ConfigError("rollout.precision applies to the local engine only (rollout.engine=local)")
        if any(g < 0 for g in self.server_gpus) or len(set(self.server_gpus)) != len(self.server_gpus):
            raise ConfigError(f"rollout.server_gpus={self.server_gpus} must be distinct GPU ids >= 0")
        if self.colocate and self.engine != "sglang":
            raise ConfigError(
                "rollout.colocate=true shares the trainer's GPUs with SGLang servers: it needs rollout.engine=sglang"
            )
        if self.colocate and self.async_rollouts:
            raise ConfigError(
                "rollout.colocate=true and rollout.async_rollouts=true exclude each other: colocated rollouts and training take turns on the same GPUs"
            )
        if self.server_gpus and len(self.server_gpus) < self.server_tp:
            raise ConfigError(
                f"rollout.server_gpus={self.server_gpus} has fewer GPUs than rollout.server_tp={self.server_tp}"
            )
        python = os.path.expanduser(self.server_python)
        if self.launch_server and self.server_python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ConfigError(
                f"rollout.server_python={self.server_python!r} is not an executable file (SGLang's Python: bash tools/setup.sh --sglang makes .venv-sglang/bin/python)"
            )
        require_positive("rollout.server_start_timeout_s", self.server_start_timeout_s)
        if not 1 <= self.server_port <= 65535:
            raise ConfigError(f"rollout.server_port={self.server_port} must be in [1, 65535]")
        if not 0 < self.mem_fraction_static <= 1:
            raise ConfigError(f"rollout.mem_fraction_static={self.mem_fraction_static} must be in (0, 1]")

    def _validate_generate_fn(self) -> None:
        require_positive("rollout.generate_timeout_s", self.generate_timeout_s)
        require_choice("rollout.failed_samples", self.failed_samples, FAILED_SAMPLES)
        if not 0 <= self.max_failed_frac <= 1:
            raise ConfigError(f"rollout.max_failed_frac={self.max_failed_frac} must be in [0, 1]")
        if self.generate_fn:
            from moe_rl.rollout.multi_turn import check_generate_fn

            try:
                check_generate_fn(self.generate_fn, dict(self.generate_kwargs))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.generate_kwargs:
            raise ConfigError("rollout.generate_kwargs are the arguments of rollout.generate_fn, which is not set")
