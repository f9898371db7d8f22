"""The RL trainer. Built once, then every step reads top to bottom:

prompts -> rollout -> rewards -> advantages (first rank; broadcast) -> this rank's
micro-batches -> old (and reference) log-probs -> policy updates through the pipeline
schedule -> optimizer step -> weight sync -> logging -> checkpoint.

The first rank drives the rollout engine, scores rewards and computes advantages over
the whole batch (so GDPO's batch statistics span every data-parallel rank), then
broadcasts the step's :class:`Experience`; every rank trains on its data-parallel share.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import Tensor
import yaml

from moe_rl import tags
from moe_rl.algorithms.rollout_correction import rollout_correction
from moe_rl.checkpoint.run_dir import check_run_dir, hold_run_dir
from moe_rl.checkpoint.catalog import CheckpointMismatch, layout_problem, remove_stale_temporaries, select_checkpoint
from moe_rl.checkpoint.store import (
    Checkpointer,
    TrainingState,
    load_checkpoint,
    load_rollout_carry,
    optimizer_settings_for,
)
from moe_rl.config import Config, ConfigError
from moe_rl.data.prompts import CHAT_TEXT_HINT, PromptFormatter
from moe_rl.data.tasks import Task, make_task
from moe_rl.experience.background import BackgroundRollout
from moe_rl.experience.builders import (
    build_collector,
    build_scorer,
    build_weight_sync,
    check_server_placement,
)
from moe_rl.experience.collector import ExperienceCollector, policy_lag
from moe_rl.experience.evaluation import Evaluator, build_evaluator
from moe_rl.experience.sample_log import FlatRewardWatch, SampleRecord, sample_records
from moe_rl.experience.types import Experience
from moe_rl.models.architectures import architecture_of, load_hf_config, model_dims
from moe_rl.models.demo_model import demo_model_dims, ensure_demo_model
from moe_rl.models.layers import LayerModules
from moe_rl.models.logprob_head import LogProbConfig
from moe_rl.rollout.weight_sync.base import WeightSync
from moe_rl.routing.expert_bias import ExpertBiasTracker
from moe_rl.routing.monitor import RoutingMonitor
from moe_rl.routing.step_replay import StepReplay
from moe_rl.trainer.batch import TrainBatch, build_train_batch
from moe_rl.trainer.experience_transport import share_experience
from moe_rl.trainer.heap import frozen_heap
from moe_rl.trainer.metrics import StepLogger, log_ratio_values, padding_frac, reduce_step, routing_split_scalars
from moe_rl.trainer.old_policy import StepRouting, old_policy_pass
from moe_rl.trainer.objective import UPDATE_REPORT, PolicyObjective, UpdateReport, kept_counts, log_ratio_percentiles
from moe_rl.trainer.rollout_mismatch import measure_rollout_mismatch
from moe_rl.trainer.packing import MicroBatchPlanner
from moe_rl.trainer.placement import Placement, build_placement, make_room_for_the_trainer
from moe_rl.trainer.policy import Policy, Reference, build_policy, build_reference_for
from moe_rl.trainer.stop import StopRequests
from parallel.collectives import (
    all_reduce,
    broadcast_object,
    is_first_rank,
    peak_memory_mb,
    rank_device,
)
from parallel.distributed import init_distributed, launch_env
from parallel.peer_failure import announce_failure

log = logging.getLogger("moe_rl.train")


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many non-finite updates); the message says why."""


@dataclass
class UpdateResult:
    """The policy updates of one step; per micro-batch lists are the last update pass's
    (on the last pipeline stage; empty elsewhere)."""

    metrics: list[dict[str, Tensor]]  # the objective's metrics and the log-ratio percentiles
    logprobs: list[Tensor]  # [b, s-1]: the policy's log-probs in the pass (on-policy: the old policy's)
    log_ratios: Tensor | None  # this rank's masked token log-ratios, for the histogram
    grad_norm: float  # of the last update
    skipped: int  # updates skipped for NaN/Inf gradients


class Trainer:
    """One RL run: ``Trainer(cfg)`` builds every part once, :meth:`train` runs the steps,
    :meth:`close` releases the engine, servers and logs (or use it as a context manager)."""

    cfg: Config
    run_dir: Path
    device: torch.device  # this rank's: batches are built on it
    hf_dir: str  # the starting weights (a HF directory)
    policy: Policy  # this rank's stage of the trained model, its DDP wrapper and optimizer
    reference: Reference | None  # frozen starting policy, for the KL penalty
    routing: StepRouting | None  # routing replay (R2/R3) and drift metrics
    start_step: int  # steps already done (resumed from a checkpoint)
    engine_routing: bool  # the engine returns routed experts
    collector: ExperienceCollector | None  # prompts -> rollout -> rewards -> advantages (first rank only)
    background: BackgroundRollout | None  # the next step's collection in flight (first rank, async rollouts)
    max_policy_lag: int  # updates the rollout weights may be behind the trained ones (async: 1)
    evaluator: Evaluator | None  # held-out problems through the same engine (first rank, with data.eval_task)
    weight_sync: WeightSync  # trainer weights -> rollout engine (every rank)
    placement: Placement  # who holds the GPUs when: trainer and engine apart, or colocated
    planner: MicroBatchPlanner  # which samples go into which micro-batch (rows, or a token budget)
    logger: StepLogger
    flat_rewards: FlatRewardWatch  # warns when the rewards tell the policy nothing (first rank)
    on_policy: bool  # one update on fresh samples: no separate old-log-prob pass

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._closing = contextlib.ExitStack()
        try:
            self._build()
        except BaseException as e:
            self._close_after(e)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.run_dir = Path(cfg.train.run_dir)
        dims = model_dims(load_hf_config(cfg.model.hf_dir)) if cfg.model.hf_dir else demo_model_dims(cfg.model)
        check_server_placement(cfg.rollout)
        # one run per run directory: a second is refused before anything else happens
        self._closing.enter_context(hold_run_dir(self.run_dir, first_rank=launch_env().rank == 0))
        check_run_dir(cfg)
        # a data file without usable problems fails here, before any model or process group
        task = _make_task(cfg, cfg.data.task, "data.task")
        eval_task = _make_task(cfg, cfg.data.eval_task, "data.eval_task") if cfg.data.eval_task else None
        # validates the layout before any group exists
        init_distributed(cfg.parallel, dims, seed=cfg.train.seed, timeout_minutes=cfg.train.collective_timeout_min)
        torch.manual_seed(cfg.train.seed)
        # denormal floats (tiny values Adam leaves in the weights) take a slow path on CPUs,
        # which slows generation with trained weights severalfold
        torch.set_flush_denormal(True)
        # a step's tokenizer calls are small (its prompts, its responses) and come between
        # model passes: handing them to the tokenizers library's thread pool costs more than
        # encoding them on this thread, and the pool would be turned off with a warning at
        # the first fork anyway; a user's setting is kept
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.device = rank_device()
        self.hf_dir = str(
            cfg.model.hf_dir or ensure_demo_model(cfg.demo_model(), cfg.parallel, cfg.optim.use_distributed_optimizer)
        )
        self.hf_config = load_hf_config(self.hf_dir)
        # the first rank's rewards first: their warm-up (lazy parsers) runs while the model builds
        scorer = build_scorer(cfg) if is_first_rank() else None
        if scorer:
            self._closing.callback(scorer.close)
        self.tokenizer = _load_tokenizer(self.hf_dir)
        formatter = _make_formatter(cfg, self.tokenizer)
        # before the rollout side: a run with no intact checkpoint is refused before any server starts
        resume_from = self._checkpoint_to_resume()  # (before the optimizer too: its kind follows the checkpoint's)
        self._write_config()
        # the rollout side before the trainer's model: colocated servers size their memory on
        # free GPUs, then give all of it back before any rank builds its state
        self.collector = (
            build_collector(cfg, self.hf_dir, self.hf_config, formatter, task, scorer, self._closing)
            if scorer
            else None
        )
        engine = self.collector.engine if self.collector else None
        make_room_for_the_trainer(cfg, engine)
        logprobs = LogProbConfig(temperature=cfg.rollout.temperature)
        modules = LayerModules(
            experts=cfg.model.experts, attention=cfg.model.attention, transformer_impl=cfg.model.transformer_impl
        )
        self.policy = build_policy(
            self.hf_config,
            self.hf_dir,
            cfg.parallel,
            optimizer_settings_for(cfg.optim, resume_from),
            total_steps=cfg.train.steps,
            replay=cfg.routing.replay,
            recompute_activations=cfg.routing.recompute_activations,
            logprob_config=logprobs,
            expert_bias_update_rate=cfg.routing.expert_bias_update_rate,
            modules=modules,
        )
        self.expert_bias = self._build_expert_bias_tracker()
        # the starting weights (taken before a resumed run loads its checkpoint)
        self.reference = (
            build_reference_for(self.policy, cfg.algorithm.reference, self.hf_dir, cfg.parallel, logprobs, modules)
            if cfg.algorithm.kl_coef > 0
            else None
        )
        self.routing = self._build_routing()
        self.checkpointer = Checkpointer(
            self.run_dir,
            cfg.train.keep_last,
            cfg.parallel,
            (self.hf_config, self.hf_dir),
            async_save=cfg.train.async_save,
            reshardable=cfg.train.checkpoint_reshardable,
        )
        self._closing.callback(
            self.checkpointer.abandon
        )  # after a failure (a finished run has waited for its last save)
        self.start_step = self._resume(resume_from)
        self.background = BackgroundRollout(self.collector) if self.collector and cfg.rollout.async_rollouts else None
        if self.background:
            self._closing.callback(self.background.close)
        # partial rollouts: a continued response's first tokens as old as rollout.max_staleness allows
        self.max_policy_lag = (
            cfg.rollout.max_staleness if cfg.rollout.partial.enabled else 1 if cfg.rollout.async_rollouts else 0
        )
        self.evaluator = (
            build_evaluator(
                cfg, eval_task, formatter, self.collector.sampler, self.collector.scorer, progress=cfg.train.progress
            )
            if eval_task and self.collector
            else None
        )
        # the engine's routed experts: for R3, and for routing metrics when it can return them
        self.engine_routing = bool(broadcast_object(self.collector.return_routing if self.collector else None))
        self.weight_sync = build_weight_sync(cfg.rollout, engine, self.run_dir, self.hf_config)
        self._closing.callback(self.weight_sync.close)
        self.placement = build_placement(cfg, engine, self.policy)
        # before the first rollout the engine serves exactly the trainer's weights (a resumed
        # run's checkpoint; servers attached by URL may serve anything until then)
        self.placement.for_rollout(lambda: self.weight_sync.push(self.policy.weights, str(self.start_step)))
        a = cfg.algorithm
        self.planner = MicroBatchPlanner(
            a.micro_batch_size, a.max_tokens_per_micro_batch, cfg.parallel.seq_len_multiple
        )
        self.logger = StepLogger(
            self.run_dir, cfg.train.steps, self.start_step, enabled=is_first_rank(), progress=cfg.train.progress
        )
        self._closing.callback(self.logger.close)
        self.flat_rewards = FlatRewardWatch(cfg.train.flat_reward_steps)
        # strictly on-policy (one update, nothing to record or measure): the update pass's
        # own log-probs are the old ones, so the extra forward pass is skipped
        self.on_policy = (
            cfg.algorithm.updates_per_batch == 1
            and cfg.algorithm.old_logprobs == "recompute"
            and self.routing is None
            and not cfg.algorithm.corrects_rollout
        )

    def _write_config(self) -> None:
        if is_first_rank():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))

    def _build_routing(self) -> StepRouting | None:
        """Replay (``routing.replay``) and the drift metrics (``routing.metrics``), either or both."""
        routing = self.cfg.routing
        if routing.replay == "none" and not routing.metrics:
            return None
        num_experts = architecture_of(self.hf_config).num_experts(self.hf_config)
        model = self.policy.model
        replay = (
            StepReplay(model, routing.replay, recompute=routing.recompute_activations)
            if routing.replay != "none"
            else None
        )
        monitor = (
            RoutingMonitor(
                model,
                self.hf_config.num_hidden_layers,
                num_experts,
                split_environment=bool(self.cfg.rollout.multi_turn.generate_fn),
                router_kl=routing.after_update_pass,
                sample_frac=routing.metrics_sample_frac,
            )
            if routing.metrics
            else None
        )
        return StepRouting(model, num_experts, replay, monitor)

    @property
    def monitor(self) -> RoutingMonitor | None:
        """The drift metrics (``None`` when ``routing.metrics`` is off)."""
        return self.routing.monitor if self.routing else None

    def _build_expert_bias_tracker(self) -> ExpertBiasTracker | None:
        arch = architecture_of(self.hf_config)
        if not arch.has_expert_bias(self.hf_config):
            return None
        pattern = arch.moe_layer_pattern(self.hf_config)
        return ExpertBiasTracker(self.policy.model, [l for l, moe in enumerate(pattern) if moe], len(pattern))

    def _checkpoint_to_resume(self) -> tuple[Path, dict] | None:
        """Collective: the newest usable checkpoint of the run directory (with ``train.resume``)."""
        if not self.cfg.train.resume:
            return None
        remove_stale_temporaries(self.run_dir)
        found = select_checkpoint(self.run_dir)
        problem = found and layout_problem(*found, self.cfg.parallel)  # (before the model is built)
        if problem:
            raise CheckpointMismatch(problem)
        return found

    def _resume(self, found: tuple[Path, dict] | None) -> int:
        """The step to start from: ``found``'s (restored), or 0."""
        if found is None:
            return 0
        path, meta = found
        load_checkpoint(path, meta, self.training_state, self.cfg.parallel)
        carry = load_rollout_carry(path) if self.collector else None
        if self.collector and carry is not None:
            self.collector.load_partial_state(cast(list, carry))
        if is_first_rank():
            log.info("resumed from %s (step %d)", path, meta["step"])
        return int(meta["step"])

    # ------------------------------------------------------------------ the run

    def train(self) -> dict[str, float]:
        """Run to ``train.steps``; returns the last step's scalars."""
        scalars: dict[str, float] = {}
        skipped_in_a_row, checkpoint, start = 0, None, time.perf_counter()
        if self.start_step >= self.cfg.train.steps and is_first_rank():
            log.warning(
                "%s is already at step %d (train.steps=%d): nothing to train; raise train.steps to go on",
                self.run_dir,
                self.start_step,
                self.cfg.train.steps,
            )
        if self.start_step == 0 and self.cfg.train.eval_every:  # the starting policy, for reference
            self.logger.log_scalars(0, self.evaluate())
        with StopRequests() as stop, frozen_heap():
            for step in range(self.start_step, self.cfg.train.steps):
                scalars = self.train_step(step)
                skipped_in_a_row = skipped_in_a_row + 1 if scalars[tags.TRAIN_UPDATE_SKIPPED] else 0
                checkpoint = self._end_of_step(step + 1, scalars, skipped_in_a_row, stop.requested()) or checkpoint
        self.checkpointer.wait()
        self.logger.summary(self.cfg.train.steps - self.start_step, scalars, checkpoint, time.perf_counter() - start)
        return scalars

    def train_step(self, step: int) -> dict[str, float]:
        """One step (0-based); returns its scalars, as logged."""
        start = time.perf_counter()
        exp, rollout_scalars, shown = self.collect_experience(step)
        rollout_time = time.perf_counter() - start
        # an earlier save whose writers finished during the rollout is committed now, not at
        # this step's end: a crash in this step's update keeps it
        self.checkpointer.poll()
        self.placement.for_training()
        batch = self.make_batch(exp, step)
        old_logprobs = self.compute_old_logprobs(batch)
        self.compute_reference_logprobs(batch)
        lr = self.policy.lr_schedule.set_step(step)
        if self.expert_bias:
            self.expert_bias.start()
        update = self.update_policy(batch, kept_counts(batch, self.cfg.algorithm.corrects_rollout))
        # on-policy the update pass's own log-probs are the old policy's
        mismatch = measure_rollout_mismatch(
            update.logprobs if old_logprobs is None else old_logprobs, batch.micro_batches, self.monitor
        )
        self.measure_routing_after_update(batch)
        routing = self.monitor.reduce() if self.monitor else {}
        if self.routing:  # before the rollout (a colocated one wants the memory)
            self.routing.release()
        bias_deltas = self.expert_bias.deltas() if self.expert_bias else {}
        train_time = time.perf_counter() - start - rollout_time
        if self.background:  # the next step's samples come from the weights it started with
            self.background.wait()
        self.placement.for_rollout(lambda: self.weight_sync.push(self.policy.weights, version=str(step + 1)))
        evaluation = self.evaluate() if self._eval_due(step + 1) else {}
        train_scalars = reduce_step(update.metrics, mismatch)
        step_time = time.perf_counter() - start
        scalars = {
            **rollout_scalars,
            **{tags.train(k): v for k, v in train_scalars.items()},
            **routing_split_scalars(routing.get("replayed", {})),
            **bias_deltas,
            tags.TRAIN_GRAD_NORM: update.grad_norm,
            tags.TRAIN_LR: lr,
            tags.TRAIN_UPDATE_SKIPPED: float(update.skipped),
            tags.PERF_STEP_TIME: step_time,
            tags.PERF_ROLLOUT_TIME: rollout_time,
            tags.PERF_TRAIN_TIME: train_time,
            tags.PERF_TOKENS_PER_S: exp.num_tokens / step_time,
            tags.PERF_PEAK_MEMORY_MB: float(all_reduce(torch.tensor([peak_memory_mb()]), "max")[0]),
            tags.PERF_PADDING_FRAC: padding_frac(batch),
            **evaluation,
        }
        log_ratios = log_ratio_values(update.log_ratios)
        self.logger.log(
            step + 1,
            scalars,
            routing,
            {tags.TRAIN_LOG_RATIO_HISTOGRAM: log_ratios} if log_ratios is not None else {},
            shown,
        )
        return scalars

    # ------------------------------------------------------------------ the stages of a step

    def collect_experience(self, step: int) -> tuple[Experience, dict[str, float], list[SampleRecord]]:
        """Prompts -> rollout -> rewards -> advantages on the first rank; each rank gets its share
        (and the first rank a few samples as text, to log). With asynchronous rollouts: the
        experience collected while the last step trained (or now, on a run's first step), and
        the next step's collection started."""
        exp = scalars = None
        shown: list[SampleRecord] = []
        if self.collector is not None:
            ready = self.background.take(step) if self.background else None
            if ready is None:
                ready = self.collector.collect(step)
            exp, scalars = ready
            scalars = {**scalars, tags.ROLLOUT_POLICY_LAG: policy_lag(exp, step, self.max_policy_lag)}
            if self.background and step + 1 < self.cfg.train.steps:
                self.background.start(step + 1)
            shown = sample_records(
                exp,
                self.tokenizer,
                step + 1,
                self.cfg.train.log_samples,
                self.cfg.rollout.group_size,
                self.cfg.reward.keep_special_tokens,
            )
            self.flat_rewards.observe(step + 1, exp.rewards.tolist(), self.cfg.rollout.max_new_tokens)
        return (*share_experience(exp, scalars, self.planner), shown)

    def make_batch(self, exp: Experience, step: int) -> TrainBatch:
        """This data-parallel rank's share as micro-batches on its device, as many as every
        other rank's (:class:`MicroBatchPlanner`: fixed rows, or packed by a token budget)."""
        return build_train_batch(
            exp,
            step,
            self.planner.plan(exp.lengths),
            seq_len_multiple=self.cfg.parallel.seq_len_multiple,
            pad_id=self.tokenizer.pad_token_id or 0,
            device=self.device,
            with_routing=self.engine_routing,
        )

    def compute_old_logprobs(self, batch: TrainBatch) -> list[Tensor] | None:
        """Sets each micro-batch's ``old_logp`` (recomputed, or the rollout's) and rollout
        correction, recording (R2) or replaying (R3) routing; returns the old pass's
        log-probs per micro-batch (empty off the last pipeline stage; ``None`` on-policy:
        no pass, the update pass's own log-probs are the old ones)."""
        if self.on_policy:
            return None
        mbs = batch.micro_batches
        outputs = old_policy_pass(self.policy.logprobs, mbs, self.routing, engine_routing=self.engine_routing)
        recompute = self.cfg.algorithm.old_logprobs == "recompute"
        a = self.cfg.algorithm
        for mb, out in zip(mbs, outputs):
            mb.old_logp = out["logprobs"] if recompute else mb.rollout_logp
            if a.corrects_rollout:
                mb.correction = rollout_correction(
                    a.rollout_correction, mb.old_logp, mb.rollout_logp, mb.mask, **a.rollout_correction_params
                )
        return [out["logprobs"] for out in outputs]

    def compute_reference_logprobs(self, batch: TrainBatch) -> None:
        """Sets each micro-batch's ``ref_logp`` when there is a KL penalty."""
        if self.reference is None:
            return
        for mb, out in zip(batch.micro_batches, self.reference.logprobs(batch.micro_batches)):
            mb.ref_logp = out["logprobs"]

    def objective_for(self, batch: TrainBatch, counts: tuple[float, float]) -> PolicyObjective:
        """The loss of this step's updates, normalised by ``counts`` (the whole step's kept
        response tokens and responses)."""
        return PolicyObjective(self.cfg.algorithm, *counts)

    def update_policy(self, batch: TrainBatch, counts: tuple[float, float]) -> UpdateResult:
        """``algorithm.updates_per_batch`` optimizer steps over the batch (routing replayed
        under R2/R3), its losses normalised by ``counts``; an update with NaN/Inf gradients
        is skipped on every rank."""
        objective = self.objective_for(batch, counts)
        result, skipped = None, 0
        for i in range(self.cfg.algorithm.updates_per_batch):
            update_pass: contextlib.AbstractContextManager[list] = (
                self.routing.update_pass() if self.routing else contextlib.nullcontext([])
            )
            with update_pass as hooks:
                result = self.policy.update(batch.micro_batches, objective, hooks)
            reports: list[UpdateReport] = [out[UPDATE_REPORT] for out in result.outputs]
            skipped += not result.updated
            if self.monitor:  # |log-ratio| and clipping by routing change since the old pass
                self.monitor.add_update_tokens(
                    [r.tokens for r in reports] or None,
                    batch.micro_batches,
                    counted=self._split_counts(i, result.updated),
                )
        if skipped and is_first_rank():
            log.warning("step %d: NaN/Inf in the loss or gradients; %d update(s) skipped", batch.step + 1, skipped)
        assert result is not None  # updates_per_batch >= 1 (config check)
        # the last pass's, once for the pass (not inside each micro-batch's loss)
        percentiles, log_ratios = log_ratio_percentiles([r.tokens for r in reports])
        metrics = [{**r.metrics, **p} for r, p in zip(reports, percentiles)]
        logprobs = [out["logprobs"] for out in result.outputs]
        return UpdateResult(metrics, logprobs, log_ratios, result.grad_norm, skipped)

    def _split_counts(self, update: int, updated: bool) -> bool:
        """Whether update pass ``update`` enters the log-ratio split by routing change: its
        ratios are against the recomputed old pass (not the rollout's log-probs, whose
        routing the split does not compare), after an optimizer step (the first pass's are
        all 1), and finite (a skipped update's may be NaN)."""
        return update > 0 and self.cfg.algorithm.old_logprobs == "recompute" and updated

    def measure_routing_after_update(self, batch: TrainBatch) -> None:
        """One more forward pass: how the updates changed routing (old -> new)."""
        if self.monitor and self.cfg.routing.after_update_pass:
            with self.monitor.after_update_pass(self.expert_bias.before() if self.expert_bias else None) as hooks:
                self.policy.logprobs(batch.micro_batches, hooks)

    def evaluate(self) -> dict[str, float]:
        """``eval/*`` of the weights the engine serves, on the first rank ({} elsewhere)."""
        if self.evaluator is None:
            return {}
        assert self.collector is not None  # an evaluator is built only with one
        with self.collector.engine.evaluation():  # the engine's trained model, without a simulated mismatch
            return self.evaluator.run()

    def _eval_due(self, step: int) -> bool:
        """After ``step`` steps: every ``train.eval_every`` steps, and at the end."""
        every = self.cfg.train.eval_every
        return self.cfg.data.eval_task is not None and (
            step == self.cfg.train.steps or bool(every and step % every == 0)
        )

    # ------------------------------------------------------------------ checkpoints, stopping

    def _end_of_step(
        self, step: int, scalars: dict[str, float], skipped_in_a_row: int, stop_requested: bool
    ) -> Path | None:
        """Checkpoint when due (or when stopping), then stop if asked to or if updates keep
        failing; the checkpoint saved, if any."""
        train = self.cfg.train
        too_many_skips = skipped_in_a_row >= train.max_skipped_updates
        due = step == train.steps or bool(train.save_every and step % train.save_every == 0)
        stopping = too_many_skips or stop_requested
        checkpoint = self.save_checkpoint(step, scalars) if due or stopping else None
        if stopping or step == train.steps:
            self.checkpointer.wait()
        else:
            self.checkpointer.poll()  # commits an earlier save whose writers are done
        if too_many_skips:
            raise TrainingStopped(
                f"{skipped_in_a_row} consecutive steps had NaN/Inf in the loss or gradients (train.max_skipped_updates="
                f"{train.max_skipped_updates}); stopped at step {step}, the checkpoint holds the last good weights"
            )
        if stop_requested:
            raise KeyboardInterrupt(f"stopped on request after step {step}; checkpoint saved")
        return checkpoint

    @property
    def training_state(self) -> TrainingState:
        return TrainingState(self.policy.model, self.policy.optimizer, self.policy.optim_settings)

    def save_checkpoint(self, step: int, scalars: dict[str, float]) -> Path:
        """Collective: start writing weights, optimizer and RNG state after ``step`` steps
        (complete once the checkpointer commits it); with HF weights at the last step and
        every ``train.export_every`` steps."""
        train = self.cfg.train
        extra = {"scalars": scalars, "fingerprint": self.cfg.fingerprint()}
        export = step == train.steps or bool(train.export_every and step % train.export_every == 0)
        with self.placement.trainer_resident(lambda: self.weight_sync.push(self.policy.weights, str(step))):
            return self.checkpointer.save(
                step,
                self.training_state,
                extra,
                hf_weights=export,
                rollout_carry=self.collector.partial_state(step) if self.collector else None,
            )

    def close(self) -> None:
        """Stop the engine and any server this run started; close the logs (idempotent)."""
        self._closing.close()

    def _close_after(self, error: BaseException | None) -> None:
        """:meth:`close`; after this rank's own failure (not a stop all ranks make together),
        first tell the other ranks, which may be waiting for this one in a collective."""
        if error is not None and not isinstance(error, TrainingStopped):
            announce_failure(error)
        self.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close_after(exc)


def train(cfg: Config) -> dict[str, float]:
    """Build a :class:`Trainer` for ``cfg``, run it, release it; the last step's scalars."""
    with Trainer(cfg) as trainer:
        return trainer.train()


def _load_tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)


def _make_task(cfg: Config, spec: str, key: str) -> Task:
    d = cfg.data
    try:
        task = make_task(spec, d.max_operand, d.prompt_key, d.answer_key, d.held_out)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{key}: {e}") from None
    if task.holds_messages and not d.chat_template:
        raise ConfigError(
            f"{key}: its prompts are chat messages ({d.prompt_key}); set data.chat_template=true (the tokenizer's chat "
            f"template writes them as text), or point data.prompt_key at {CHAT_TEXT_HINT}"
        )
    return task


def _make_formatter(cfg: Config, tokenizer) -> PromptFormatter:
    try:
        return cfg.data.prompt_formatter(tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
