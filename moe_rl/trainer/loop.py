"""The RL training loop, top to bottom:

prompts -> rollout -> rewards -> advantages -> old (and reference) log-probs ->
policy update over micro-batches through the pipeline schedule -> optimizer step ->
weight sync -> logging -> checkpoint.

Rank 0 drives the rollout engine, scores rewards and computes advantages over the whole
batch (so GDPO's batch statistics span every data-parallel rank), then broadcasts the
step's experience; every rank trains on its data-parallel share.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from moe_rl.algorithms import compute_advantages, entropy_bonus, kl_penalty, policy_loss
from moe_rl.config import Config, ConfigError
from moe_rl.models.forward import MicroBatch, run_microbatches
from moe_rl.trainer.experience import Experience, build_microbatches, padded_length

log = logging.getLogger("moe_rl.train")

class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many non-finite updates); the message says why."""


class _StopRequests:
    """SIGINT/SIGTERM ask the loop to stop after the current step (all ranks agree)."""

    def __init__(self) -> None:
        self._flag = False
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame) -> None:
        if self._flag:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._flag = True
        log.warning("stop requested (signal %d): finishing this step and saving a checkpoint", signum)

    def requested(self) -> bool:
        flag = torch.tensor([1.0 if self._flag else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


MEAN_KEYS = ("loss", "pg_loss", "clip_frac", "ratio_mean", "approx_kl", "entropy", "kl_ref", "log_ratio_p01", "log_ratio_p99")


def train(cfg: Config) -> dict:
    """Run ``cfg`` to ``train.steps``; returns the last step's scalars (rank 0)."""
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from moe_rl.data.tasks import make_task
    from moe_rl.models.architectures import architecture_of, model_dims
    from moe_rl.models.builder import build_model, load_hf_config, make_transformer_config
    from moe_rl.models.hf_weights import load_hf_weights
    from moe_rl.rewards import ConditionalSpec, RewardScorer, RewardSpec
    from moe_rl.routing.monitor import RoutingMonitor
    from moe_rl.routing.replay import replay_config_overrides
    from moe_rl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from moe_rl.trainer.demo_model import demo_model_dims, ensure_demo_model
    from moe_rl.trainer.metrics import StepLogger
    from parallel.distributed import init_distributed
    from parallel.layout import ParallelLayout
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    # ---------------------------------------------------------------- setup
    layout = ParallelLayout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.etp)
    run_dir = Path(cfg.train.run_dir)
    hf_dir_hint = cfg.model.hf_dir
    dims = model_dims(load_hf_config(hf_dir_hint)) if hf_dir_hint else demo_model_dims(cfg)
    init_distributed(layout, dims, seed=cfg.train.seed)  # validates the layout before any group exists
    rank = dist.get_rank()
    torch.manual_seed(cfg.train.seed)
    # denormal floats (tiny values Adam leaves in the weights) take a slow path on CPUs:
    # generation with trained weights ran ~3x slower without this
    torch.set_flush_denormal(True)
    hf_dir = str(hf_dir_hint or ensure_demo_model(cfg))
    hf_config = load_hf_config(hf_dir)
    arch = architecture_of(hf_config)
    num_experts = arch.num_experts(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    try:
        task = make_task(cfg.data.task, cfg.data.max_operand)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data.task: {e}") from None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    recompute = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if cfg.routing.recompute_activations
        else {}
    )
    config = make_transformer_config(hf_config, layout, **replay_config_overrides(cfg.routing.replay), **recompute)
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, hf_dir)
    settings = OptimSettings(
        lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, clip_grad=cfg.optim.clip_grad,
        adam_beta1=cfg.optim.adam_beta1, adam_beta2=cfg.optim.adam_beta2,
        use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
    )  # fmt: skip
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    reference = None
    if cfg.algorithm.kl_coef > 0:
        ref_config = make_transformer_config(hf_config, layout)
        reference = build_model(hf_config, ref_config)
        load_hf_weights(reference, hf_config, hf_dir)
        reference.eval()
    monitor = None
    if cfg.routing.replay != "none" or cfg.routing.metrics:
        monitor = RoutingMonitor(
            model, cfg.routing.replay, hf_config.num_hidden_layers, num_experts, recompute=bool(recompute)
        )

    start_step = 0
    found = latest_checkpoint(run_dir) if cfg.train.resume else None
    if found is not None:
        meta = load_checkpoint(found[1], model, hf_config, optimizer)
        start_step = int(meta["step"])
        if rank == 0:
            log.info("resumed from %s (step %d)", found[1], start_step)

    engine = scorer = server = None
    if rank == 0:
        scorer = RewardScorer(
            [RewardSpec(r.name, r.fn, r.weight, dict(r.kwargs)) for r in cfg.reward.rewards],
            [ConditionalSpec(c.target, c.condition, c.threshold) for c in cfg.reward.conditionals],
            timeout_s=cfg.reward.timeout_s,
        )
        engine, server = _make_engine(cfg, hf_dir, hf_config, run_dir)
    _sync_weights(cfg, model, hf_config, engine, run_dir, version=str(start_step), initial=found is None)
    logger = StepLogger(run_dir, cfg.train.steps, start_step, enabled=rank == 0, progress=cfg.train.progress)

    from moe_rl.rollout.types import SamplingParams

    sampling = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        stop_token_ids=(tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else (),
    )  # fmt: skip
    want_routing = cfg.routing.replay == "r3" or (cfg.routing.metrics and cfg.rollout.engine == "local")
    model.logprob_config.temperature = cfg.rollout.temperature if hasattr(model, "logprob_config") else 1.0
    if reference is not None and hasattr(reference, "logprob_config"):
        reference.logprob_config.temperature = cfg.rollout.temperature
    scalars: dict = {}
    skipped_in_a_row = 0
    stop = _StopRequests()
    nan_steps = {int(x) for x in os.environ.get("MOE_RL_FAULT_NAN_STEPS", "").split(",") if x.strip()}
    try:
        for step in range(start_step, cfg.train.steps):
            t0 = time.perf_counter()
            # ------------------------------------------------ rollout, rewards, advantages (rank 0)
            exp, rollout_scalars = None, {}
            if rank == 0:
                with cpu_bridge_paused():
                    exp, rollout_scalars = _collect(cfg, step, task, tokenizer, engine, scorer, sampling, want_routing, layout.tp)
            exp, rollout_scalars = _broadcast((exp, rollout_scalars))
            t_rollout = time.perf_counter() - t0

            # ------------------------------------------------ this rank's micro-batches
            dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            mine = list(range(dp_rank, len(exp.samples), dp_size))
            batches = build_microbatches(exp, mine, cfg.algorithm.micro_batch_size, pad_id=tokenizer.pad_token_id or 0)
            num_tokens = float(exp.num_response_tokens)
            num_seqs = float(sum(1 for s in exp.samples if s.output_ids))

            # ------------------------------------------------ old (and reference) log-probs
            engine_routing = [mb.extras["routed"] for mb in batches] if want_routing else None
            # strictly on-policy (one update, nothing to record or measure): the update
            # pass's own log-probs are the old ones, so the extra forward pass is skipped
            on_policy = cfg.algorithm.updates_per_batch == 1 and cfg.algorithm.old_logprobs == "recompute" and monitor is None
            mismatch = []
            if not on_policy:
                hooks = monitor.old_pass_hooks(batches, engine_routing) if monitor else []
                old = run_microbatches([ddp], batches, hooks=hooks)
                if monitor:
                    monitor.end_old_pass()
                mismatch = _attach_old_logprobs(cfg, batches, old)
            if reference is not None:
                for mb, out in zip(batches, run_microbatches(reference, batches)):
                    mb.extras["ref_logp"] = out["logprobs"]

            # ------------------------------------------------ policy updates
            loss_fn = _make_loss_fn(cfg, num_tokens, num_seqs, inject_nan=step + 1 in nan_steps)
            result, skipped = None, 0
            for _ in range(cfg.algorithm.updates_per_batch):
                hooks = monitor.update_pass_hooks() if monitor else []
                result = train_step(
                    [ddp], optimizer,
                    lambda hooks=hooks: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False, hooks=hooks),
                )  # fmt: skip
                if monitor:
                    monitor.end_update_pass()
                skipped += not result.updated
            if skipped:
                skipped_in_a_row += 1
                if rank == 0:
                    log.warning("step %d: NaN/Inf in the loss or gradients; %d update(s) skipped", step + 1, skipped)
            else:
                skipped_in_a_row = 0
            if monitor and cfg.routing.metrics and cfg.routing.after_update_pass:
                run_microbatches([ddp], batches, hooks=monitor.after_update_hooks())
                monitor.end_after_update()
            t_train = time.perf_counter() - t0 - t_rollout

            # ------------------------------------------------ weight sync
            _sync_weights(cfg, model, hf_config, engine, run_dir, version=str(step + 1))

            # ------------------------------------------------ logging
            train_scalars = _reduce_outputs(result.outputs, ps)
            if on_policy and ps.is_pipeline_last_stage():
                mismatch = [mb.extras["mismatch"] for mb in batches if "mismatch" in mb.extras]
            train_scalars.update(_reduce_mismatch(mismatch))
            routing = monitor.reduce() if (monitor and cfg.routing.metrics) else {}
            step_time = time.perf_counter() - t0
            total_tokens = sum(len(s.prompt_ids) + len(s.output_ids) for s in exp.samples)
            scalars = {
                **rollout_scalars,
                **{f"train/{k}": v for k, v in train_scalars.items()},
                "train/grad_norm": result.grad_norm,
                "train/update_skipped": float(skipped),
                "perf/step_time_s": step_time,
                "perf/rollout_time_s": t_rollout,
                "perf/train_time_s": t_train,
                "perf/tokens_per_s": total_tokens / step_time,
            }
            log_ratios = [mb.extras["log_ratio"] for mb in batches if "log_ratio" in mb.extras]
            logger.log(step + 1, scalars, routing, {"train/log_ratio": torch.cat(log_ratios)} if log_ratios else {})

            # ------------------------------------------------ checkpoint
            too_many_skips = skipped_in_a_row >= cfg.train.max_skipped_updates
            stopping = stop.requested()
            last = step + 1 == cfg.train.steps
            if last or too_many_skips or stopping or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
                save_checkpoint(run_dir, step + 1, model, hf_config, optimizer, {"scalars": scalars},
                                cfg.train.keep_last, tokenizer_dir=hf_dir)  # fmt: skip
            if too_many_skips:
                raise TrainingStopped(
                    f"{skipped_in_a_row} consecutive steps had NaN/Inf in the loss or gradients (train.max_skipped_updates="
                    f"{cfg.train.max_skipped_updates}); stopped at step {step + 1}, the checkpoint holds the last good weights"
                )
            if stopping:
                raise KeyboardInterrupt(f"stopped on request after step {step + 1}; checkpoint saved")
    finally:
        stop.restore()
        logger.close()
        if engine is not None:
            engine.close()
        if server is not None:
            server.stop()
    return scalars


# -------------------------------------------------------------------- rollout side


def _make_engine(cfg: Config, hf_dir: str, hf_config, run_dir: Path):
    r = cfg.rollout
    if r.engine == "local":
        from moe_rl.rollout.local import LocalEngine

        return LocalEngine(hf_dir), None
    from moe_rl.rollout.server import ServerSettings, SGLangServer
    from moe_rl.rollout.sglang import SGLangEngine

    server = None
    urls = list(r.sglang_urls)
    if r.launch_server:
        settings = ServerSettings(
            model_path=hf_dir, port=r.server_port, tp_size=r.server_tp, ep_size=r.server_ep,
            mem_fraction_static=r.mem_fraction_static, return_routed_experts=cfg.routing.replay == "r3",
            deterministic=True, seed=cfg.train.seed,
        )  # fmt: skip
        server = SGLangServer(settings, run_dir / "logs")
        server.wait_healthy()
        urls = [server.url]
    engine = SGLangEngine(urls, num_layers=hf_config.num_hidden_layers, top_k=hf_config.num_experts_per_tok)
    engine.wait_healthy()
    if cfg.routing.replay == "r3":
        engine.check_returns_routed_experts()
    return engine, server


def _collect(cfg: Config, step: int, task, tokenizer, engine, scorer, sampling, want_routing: bool, tp: int):
    from moe_rl.rewards import RewardInput

    problems = task.problems(cfg.train.seed, step, cfg.rollout.prompts_per_step)
    prompts, truncated = [], 0
    for p in problems:
        ids = tokenizer(p.prompt)["input_ids"]
        if len(ids) > cfg.data.max_prompt_tokens:
            ids, truncated = ids[-cfg.data.max_prompt_tokens :], truncated + 1
        prompts.append(ids)
    groups = engine.generate(
        prompts, cfg.rollout.group_size, sampling, seed=cfg.train.seed * 100_003 + step, return_routed_experts=want_routing
    )
    samples = [s for g in groups for s in g]
    eos = tokenizer.eos_token_id
    inputs = []
    for i, s in enumerate(samples):
        out = s.output_ids[:-1] if s.output_ids and s.output_ids[-1] == eos else s.output_ids
        inputs.append(RewardInput(problems[i // cfg.rollout.group_size].prompt, tokenizer.decode(out),
                                  problems[i // cfg.rollout.group_size].answer, len(s.output_ids)))  # fmt: skip
    batch = scorer.score(inputs)
    advantages = compute_advantages(cfg.algorithm.advantage, batch.values, cfg.rollout.group_size, weights=batch.weights)
    exp = Experience(samples, batch.values, batch.names, advantages, padded_length(samples, tp))
    grouped = advantages.view(-1, cfg.rollout.group_size)
    scalars = {
        "reward/total": float(batch.total().mean()),
        **{f"reward/{n}": float(batch.values[:, j].mean()) for j, n in enumerate(batch.names)},
        **{f"reward/failures/{n}": float(sum(c.values())) for n, c in batch.failures.items()},
        "advantage/mean": float(advantages.mean()),
        "advantage/std": float(advantages.std()) if len(advantages) > 1 else 0.0,
        "advantage/distinct_per_group": float(sum(len(set(g.tolist())) for g in grouped) / len(grouped)),
        "response/length_mean": float(sum(len(s.output_ids) for s in samples) / len(samples)),
        "response/length_max": float(max(len(s.output_ids) for s in samples)),
        "response/finished_frac": float(sum(s.finish_reason == "stop" for s in samples) / len(samples)),
        "data/truncated_prompts": float(truncated),
        "data/skipped_lines": float(len(getattr(task, "skipped", []))),
    }
    return exp, scalars


def cpu_bridge_paused():
    """The CPU bridge's mode is not needed (and slow) outside megatron code."""
    import contextlib

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from parallel import cpu_bridge

    return cpu_bridge.paused()


def _broadcast(obj):
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync_weights(cfg: Config, model, hf_config, engine, run_dir: Path, version: str, initial: bool = False) -> None:
    """Push the trainer's weights to the rollout engine (collective)."""
    from moe_rl.models.hf_weights import export_hf_weights, gather_hf_tensors

    if initial and cfg.rollout.precision == "fp32":
        return  # the engine loaded the same checkpoint
    if cfg.rollout.engine == "sglang":
        path = run_dir / "weights" / "current"
        export_hf_weights(model, hf_config, path)
        if engine is not None:
            engine.update_weights_from_disk(str(path.resolve()), version)
        return
    tensors = gather_hf_tensors(model, hf_config)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(tensors, parts, dst=0)
    if engine is not None:
        merged = {k: v for part in parts for k, v in part.items()}
        if cfg.rollout.precision == "bf16":  # an inference engine's lower precision (computed in fp32)
            merged = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in merged.items()}
        engine.update_weights(merged, version)


# -------------------------------------------------------------------- training side


def _attach_old_logprobs(cfg: Config, batches: list[MicroBatch], old: list[dict]) -> list[tuple[float, float, float]]:
    """``extras["old_logp"]`` from the recomputed pass (or the rollout's); returns
    (sum |recomputed - rollout|, max, tokens) per micro-batch (last stage only)."""
    out = []
    for mb, res in zip(batches, old):
        recomputed, rollout, mask = res["logprobs"], mb.extras["rollout_logp"], mb.extras["mask"]
        mb.extras["old_logp"] = recomputed if cfg.algorithm.old_logprobs == "recompute" else rollout
        diff = (recomputed - rollout).abs() * mask
        out.append((float(diff.sum()), float(diff.max()) if diff.numel() else 0.0, float(mask.sum())))
    return out


def _make_loss_fn(cfg: Config, num_tokens: float, num_seqs: float, inject_nan: bool = False):
    a = cfg.algorithm
    agg = a.loss_params.get("agg")

    def loss_fn(logp_entropy: torch.Tensor, mb: MicroBatch):
        logp, entropy = logp_entropy[..., 0], logp_entropy[..., 1]
        mask, adv = mb.extras["mask"], mb.extras["advantages"]
        old = mb.extras.get("old_logp")
        if old is None:  # on-policy: the old policy is this one
            old = logp.detach()
            diff = (old - mb.extras["rollout_logp"]).abs() * mask
            mb.extras["mismatch"] = (float(diff.sum()), float(diff.max()) if diff.numel() else 0.0, float(mask.sum()))
        loss, metrics = policy_loss(a.loss, logp, old, adv, mask, **a.loss_params, num_tokens=num_tokens, num_seqs=num_seqs)
        metrics = {k: v for k, v in metrics.items() if k != "dual_clip_frac"}
        metrics["pg_loss"] = loss.detach()
        common = dict(agg=agg or "token-mean", num_tokens=num_tokens, num_seqs=num_seqs)
        if a.kl_coef > 0:
            kl = kl_penalty(logp, mb.extras["ref_logp"], mask, a.kl_estimator, **common)
            loss = loss + a.kl_coef * kl
            metrics["kl_ref"] = kl.detach() * num_tokens / max(float(mask.sum()), 1.0)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * entropy_bonus(entropy, mask, **common)
        tokens = mask.sum().clamp(min=1)
        metrics["entropy"] = (entropy.detach() * mask).sum() / tokens
        log_ratio = (logp.detach() - old)[mask.bool()]
        mb.extras["log_ratio"] = log_ratio  # the last update's, for the histogram
        if log_ratio.numel():
            metrics["log_ratio_p01"] = torch.quantile(log_ratio.float(), 0.01)
            metrics["log_ratio_p99"] = torch.quantile(log_ratio.float(), 0.99)
        if inject_nan:  # fault injection for tests (MOE_RL_FAULT_NAN_STEPS)
            loss = loss * float("nan")
        metrics["loss"] = loss.detach()
        metrics["_tokens"] = mask.sum()
        return loss, metrics

    return loss_fn


def _reduce_outputs(outputs: list[dict], ps) -> dict[str, float]:
    """Token-weighted means of the loss metrics over micro-batches and data-parallel
    ranks (the pipeline's last stage, tensor rank 0 reports); min/max of the ratio."""
    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    sums = torch.zeros(len(MEAN_KEYS) + 1, dtype=torch.float64)
    extremes = torch.tensor([float("inf"), float("inf")], dtype=torch.float64)  # min ratio, -max ratio
    if reporter:
        for out in outputs:
            w = float(out.get("_tokens", 1.0))
            for i, key in enumerate(MEAN_KEYS):
                if key in out:
                    sums[i] += float(out[key]) * (1.0 if key == "loss" or key == "pg_loss" else w)
            sums[-1] += w
            extremes[0] = min(extremes[0], float(out["ratio_min"]))
            extremes[1] = min(extremes[1], -float(out["ratio_max"]))
    dist.all_reduce(sums)
    dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
    tokens = max(float(sums[-1]), 1.0)
    result = {key: float(sums[i]) / (1.0 if key in ("loss", "pg_loss") else tokens) for i, key in enumerate(MEAN_KEYS)}
    result["ratio_min"], result["ratio_max"] = float(extremes[0]), float(-extremes[1])
    return result


def _reduce_mismatch(parts: list[tuple[float, float, float]]) -> dict[str, float]:
    total = torch.tensor([sum(p[0] for p in parts), sum(p[2] for p in parts)], dtype=torch.float64)
    worst = torch.tensor([max((p[1] for p in parts), default=0.0)], dtype=torch.float64)
    dist.all_reduce(total)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"logp_mismatch_mean": float(total[0] / total[1].clamp(min=1)), "logp_mismatch_max": float(worst[0])}
