"""The rollout side of a run, built once from the config: the engine (and any SGLang
server the run starts), the sampler, the reward scorer, the first rank's
:class:`ExperienceCollector` and every rank's :class:`WeightSync`. The engine kind is
looked at here and nowhere else."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from moe_rl.config import Config, ConfigError
from moe_rl.data.prompts import PromptFormatter
from moe_rl.data.tasks import Task
from moe_rl.models.architectures import architecture_of, hf_dtype
from moe_rl.rewards import ConditionalSpec, RewardScorer, RewardSpec
from moe_rl.rollout.multi_turn import MultiTurnSampler, load_generate_fn
from moe_rl.rollout.partial import PartialRollout
from moe_rl.rollout.sampler import Sampler
from moe_rl.rollout.single_turn import SingleTurnSampler
from moe_rl.rollout.settings import PRECISIONS, MultiTurnConfig, RolloutConfig, ServerConfig
from moe_rl.rollout.types import RolloutEngine, RolloutError, SamplingParams
from moe_rl.rollout.weight_sync.base import WeightSync
from moe_rl.rollout.weight_sync.disk import DiskSync
from moe_rl.rollout.weight_sync.distributed import DistributedSync
from moe_rl.rollout.weight_sync.in_process import InProcessSync
from moe_rl.rollout.weight_sync.tensor import TensorSync
from moe_rl.experience.collector import ExperienceCollector

log = logging.getLogger("moe_rl.train")
if TYPE_CHECKING:
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer


def wants_engine_routing(cfg: Config) -> bool:
    """R3 replays the engine's routing; routing metrics compare the trainer's with it."""
    return cfg.routing.replay == "r3" or cfg.routing.metrics


def build_collector(
    cfg: Config,
    hf_dir: str,
    hf_config: PretrainedConfig,
    formatter: PromptFormatter,
    task: Task,
    scorer: RewardScorer,
    closing: contextlib.ExitStack,
) -> ExperienceCollector:
    """The first rank's collector (scoring with ``scorer``); what it starts is registered
    on ``closing``. Its ``return_routing`` says whether the run gets the engine's routing."""
    engine = build_engine(cfg, hf_dir, hf_config, closing)
    return ExperienceCollector(
        rollout=cfg.rollout,
        advantage=cfg.algorithm.advantage,
        seed=cfg.train.seed,
        task=task,
        formatter=formatter,
        engine=engine,
        sampler=build_sampler(
            cfg.rollout.multi_turn, engine, formatter.tokenizer, getattr(hf_config, "max_position_embeddings", None)
        ),
        scorer=scorer,
        sampling=sampling_params(cfg, formatter.tokenizer.eos_token_id),
        return_routing=use_engine_routing(cfg, engine),
        partial=build_partial_rollout(cfg.rollout, engine),
    )


def build_partial_rollout(rollout: RolloutConfig, engine: RolloutEngine) -> PartialRollout | None:
    """The carry of partial rollouts (``rollout.partial.enabled``), else ``None``."""
    if not rollout.partial.enabled:
        return None
    return PartialRollout(
        engine, rollout.group_size, rollout.prompts_per_step, rollout.partial.extra_groups, rollout.max_staleness
    )


def build_sampler(
    multi_turn: MultiTurnConfig, engine: RolloutEngine, tokenizer, max_tokens: int | None = None
) -> Sampler:
    """``rollout.multi_turn.generate_fn``: one engine call per sample (unset), or the user's
    function (multi-turn, :mod:`moe_rl.rollout.multi_turn`; transcripts cut to ``max_tokens``,
    the model's context)."""
    if not multi_turn.generate_fn:
        return SingleTurnSampler(engine)
    return MultiTurnSampler(
        engine,
        load_generate_fn(multi_turn.generate_fn),
        tokenizer,
        kwargs=dict(multi_turn.generate_kwargs),
        timeout_s=multi_turn.timeout_s,
        max_tokens=max_tokens,
    )


def sampling_params(cfg: Config, eos_token_id: int | None, *, evaluation: bool = False) -> SamplingParams:
    """The rollout's sampling (``evaluation``: at ``data.eval_temperature``); stops at EOS."""
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=cfg.data.eval_temperature if evaluation else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=(eos_token_id,) if eos_token_id is not None else (),
    )


def use_engine_routing(cfg: Config, engine: RolloutEngine) -> bool:
    """Ask ``engine`` for routed experts? R3 needs them; routing metrics use them when the
    engine can return them (one warning when it cannot)."""
    if not wants_engine_routing(cfg):
        return False
    r3 = cfg.routing.replay == "r3"
    try:
        if engine.returns_routed_experts():
            return True
        why = "the rollout engine does not return routed experts: start SGLang with --enable-return-routed-experts"
    except RolloutError as e:  # e.g. a router in front of the servers without /server_info
        if r3:
            raise
        why = f"cannot tell whether the rollout engine returns routed experts ({e})"
    if r3:
        raise RolloutError(f"routing.replay=r3 needs the rollout engine's routed experts; {why}")
    log.warning("routing/train_vs_rollout/* (train-inference routing drift) is not measured: %s", why)
    return False


def build_scorer(cfg: Config) -> RewardScorer:
    return RewardScorer(
        [RewardSpec(r.name, r.fn, r.weight, dict(r.kwargs)) for r in cfg.reward.rewards],
        [ConditionalSpec(c.target, c.condition, c.threshold) for c in cfg.reward.conditionals],
        timeout_s=cfg.reward.timeout_s,
        workers=cfg.reward.workers,
        keep_special_tokens=cfg.reward.keep_special_tokens,
        score_as_finished=cfg.reward.score_as_finished,
    )


def build_engine(cfg: Config, hf_dir: str, hf_config: PretrainedConfig, closing: contextlib.ExitStack) -> RolloutEngine:
    """``rollout.engine``: the local engine, or SGLang servers (started here when
    ``rollout.server.launch``, else attached by URL)."""
    r = cfg.rollout
    if r.engine == "local":
        return _local_engine(r, cfg.train.seed, hf_dir, closing)
    from moe_rl.rollout.sglang.engine import SGLangEngine

    launched = []
    if r.server.launch:
        settings = server_settings(
            r.server, hf_dir, return_routed_experts=wants_engine_routing(cfg), seed=cfg.train.seed, colocate=r.colocate
        )
        launched.append(_start_server(settings, r.server.start_timeout_s, Path(cfg.train.run_dir) / "logs", closing))
    urls = [server.url for server in launched] or list(r.server.urls)
    engine = SGLangEngine(
        urls,
        num_layers=hf_config.num_hidden_layers,
        top_k=hf_config.num_experts_per_tok,
        num_experts=architecture_of(hf_config).num_experts(hf_config),
        max_concurrency=r.server.concurrency * len(urls),
        timeout_s=r.server.request_timeout_s,
        nccl_version_probes=[server.nccl_version for server in launched] or None,
    )
    closing.callback(engine.close)
    engine.wait_healthy()
    return engine


def _local_engine(r: RolloutConfig, seed: int, hf_dir: str, closing: contextlib.ExitStack) -> RolloutEngine:
    """The built-in engine at ``rollout.precision``, with ``rollout.simulate_mismatch``."""
    from moe_rl.rollout.local import LocalEngine

    precision = PRECISIONS[r.precision]
    local = LocalEngine(
        hf_dir,
        weight_precision=getattr(torch, precision) if precision else None,
        mismatch=r.simulate_mismatch,
        mismatch_seed=seed * 1_000_003 + r.simulate_mismatch.seed,
    )
    closing.callback(local.close)
    return local


def server_settings(
    server: ServerConfig, hf_dir: str, *, return_routed_experts: bool, seed: int, colocate: bool = False
) -> ServerSettings:
    """How this run launches its SGLang server: on a machine without CUDA, SGLang's CPU
    backend (and no deterministic inference, which needs its CUDA kernels); ``colocate``:
    with its memory saver, to share the trainer's GPUs."""
    from moe_rl.rollout.sglang.server import ServerSettings

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and server.deterministic:
        log.info("SGLang on CPU: --enable-deterministic-inference is left out (it needs CUDA kernels)")
    python = os.path.expanduser(server.python) if server.python else sys.executable
    return ServerSettings(
        model_path=hf_dir,
        port=server.port,
        tp_size=server.tp,
        ep_size=server.ep,
        mem_fraction_static=server.mem_fraction_static,
        return_routed_experts=return_routed_experts,
        deterministic=server.deterministic,
        seed=seed,
        gpus=tuple(server.gpus) or None,
        memory_saver=colocate,
        device=device,
        extra_args=list(server.args),
        launch_command=[python, "-m", "sglang.launch_server"],
    )


def _start_server(
    settings: ServerSettings, timeout_s: float, log_dir: Path, closing: contextlib.ExitStack
) -> SGLangServer:
    from moe_rl.rollout.sglang.server import SGLangServer

    server = SGLangServer(settings, log_dir)
    closing.callback(server.stop)
    server.wait_healthy(timeout_s=timeout_s)
    return server


def check_server_placement(r: RolloutConfig) -> None:
    """Before anything starts: a server this run launches gets GPUs of its own (unless it
    is meant to share the trainer's: ``rollout.colocate``)."""
    from moe_rl.rollout.sglang.server import check_server_gpus
    from parallel.distributed import node_gpu_ids

    if r.server.launch and not r.colocate:
        try:
            check_server_gpus(r.server.gpus, node_gpu_ids())
        except ValueError as e:
            raise ConfigError(str(e)) from None


def build_weight_sync(
    r: RolloutConfig, engine: RolloutEngine | None, run_dir: Path, hf_config: PretrainedConfig
) -> WeightSync:
    """Every rank's half of the weight sync (``engine`` is ``None`` off the first rank):
    in process for the local engine; for SGLang ``rollout.weight_sync.method``: buckets over
    a weight-update group in the served dtype, or through ``run_dir/weights/current``."""
    if r.engine == "local":
        return InProcessSync(engine)
    sync = r.weight_sync
    bucket_bytes, dtype = max(1, int(sync.bucket_mb * 2**20)), hf_dtype(hf_config)
    if sync.method == "distributed":
        return DistributedSync(engine, bucket_bytes=bucket_bytes, dtype=dtype, address=sync.address)
    if sync.method == "tensor":
        # a server this run launches on rollout.server.gpus: its TP rank i on the i-th of them
        gpus = [[str(g) for g in r.server.gpus]] if r.server.launch and r.server.gpus else None
        return TensorSync(engine, bucket_bytes=bucket_bytes, dtype=dtype, server_gpus=gpus)
    return DiskSync(engine, run_dir / "weights" / "current")
