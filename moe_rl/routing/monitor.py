"""Routing drift in one RL training step, measured wherever the data exists; it only
observes (replay, which changes the forward, is :class:`~moe_rl.routing.step_replay.StepReplay`).
Each pass of a step is a context that yields the pass's forward hooks, so a pass can
never be left open:

    with monitor.old_pass(batches, engine_indices) as hooks:   # the old policy's routing
        old = run_microbatches(model, batches, hooks=hooks)
    with monitor.update_pass() as hooks:                      # once per update
        outputs = train_step(..., run_microbatches(..., hooks=hooks))
    monitor.add_update_tokens(tokens, batches, counted=True)  # split by routing change
    monitor.add_rollout_logp_mismatch(old_logps, batches)    # split by train/rollout routing
    with monitor.after_update_pass() as hooks:                # optional: what an update changed
        run_microbatches(model, batches, hooks=hooks)
    metrics = monitor.reduce()                                 # collective

:meth:`reduce` gives the groups to log with :func:`moe_rl.routing.tensorboard.log_routing`:
``old_vs_new`` (old policy -> updated policy), ``train_vs_rollout`` (trainer -> engine,
when the engine returned routing), ``replayed`` (what the old pass dispatched -> what an
update pass dispatched: zero under r2 and r3, the routing the updates changed without
replay), ``load`` (expert load, old pass) and, for routers with an expert bias,
``expert_bias_effect`` (the updated routers with the step's old biases -> with its new
ones: the routing the bias update alone changed). Per-token values are split by whether the
token's routing differed in any layer: ``train_vs_rollout`` the old pass's
``|trainer - engine|`` log-prob (``logp_mismatch_routing_changed`` / ``_same``),
``replayed`` the update passes' ``|log-ratio|`` and clipping (``log_ratio_abs_...``,
``clip_frac_...``).

The hooks of a step's replay and of this monitor go together into each pass (the replay's
last: the probe reads what the router chose). The old pass keeps its routing for the step (expert indices in their compact type, and the
router distributions in host memory only when ``router_kl`` is wanted); with
``sample_frac`` < 1 every pass observes only that share of each micro-batch's tokens (a
seeded draw, the same on every rank holding those tokens), weighted so that counts
estimate all tokens. Replay always covers every token.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol, Sequence

import torch
from megatron.core import parallel_state as ps
from torch import Tensor

from moe_rl.models.forward import MicroBatch, megatron_module
from moe_rl.routing.probe import Consumer, ProbedRouting, RouterProbe
from moe_rl.routing.replay import to_local_tokens
from moe_rl.routing.stats import RoutingStats

STAT_GROUPS = ("old_vs_new", "train_vs_rollout", "replayed", "load", "expert_bias_effect")
ENVIRONMENT_GROUP = "train_vs_rollout_environment"  # with split_environment


def _mismatch_token_values(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """``[b, s-1, 3]``: ``|log r|``, k3 ``r - 1 - log r`` (``log r`` = trainer - rollout) and
    the token weights."""
    lr = log_ratio.clamp(-20.0, 20.0)
    return torch.stack([lr.abs() * mask, (torch.expm1(lr) - lr) * mask, mask], -1)


class RoutingMonitor:
    """The drift metrics of a step's passes. ``split_environment`` (multi-turn runs): the
    train-vs-rollout routing of the tokens environments inserted is also reported on its
    own (``train_vs_rollout_environment``). ``router_kl``: keep the old pass's router
    distributions for the after-update pass's ``router_kl`` (set it false when no such pass
    runs). ``sample_frac``: the share of each micro-batch's tokens the metrics observe."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_layers: int,
        num_experts: int,
        *,
        split_environment: bool = False,
        router_kl: bool = True,
        sample_frac: float = 1.0,
    ) -> None:
        if not 0 < sample_frac <= 1:
            raise ValueError(f"sample_frac={sample_frac} must be in (0, 1]")
        self.router_kl, self.sample_frac = router_kl, sample_frac
        self._tokens: list[Tensor] | None = None  # per micro-batch: the observed tokens (None: all)
        self._weights: list[float] = []  # per micro-batch: tokens / observed tokens
        self._passes = 0
        self.probe = RouterProbe(model)
        self.split_environment = split_environment
        self.num_layers, self.num_experts = num_layers, num_experts
        self._old: list[ProbedRouting] = []
        self._masks: list[Tensor] = []
        self._environment_masks: list[Tensor] = []
        self._engine: list[list[Tensor]] | None = None
        self._engine_routed: list[Tensor] | None = None  # 1 where the engine routed (else filler)
        self._stats: dict[str, RoutingStats] = {}
        self._config = megatron_module(model).config

    # ------------------------------------------------------------ step phases

    @contextlib.contextmanager
    def old_pass(
        self,
        batches: Sequence[MicroBatch],
        engine_indices: Sequence[Sequence[Tensor]] | None = None,
        engine_routed: Sequence[Tensor] | None = None,
    ) -> Iterator[list]:
        """The old-policy pass over ``batches``; ``engine_indices``: the engine's routing as
        this rank's per-layer indices (:func:`~moe_rl.routing.step_replay.engine_indices`),
        for the train-vs-rollout drift, at the positions ``engine_routed`` marks
        (:func:`~moe_rl.routing.step_replay.engine_routed_positions`; all when ``None``):
        the filler elsewhere is no routing the engine chose."""
        hooks = self._begin_old_pass(batches, engine_indices, engine_routed)
        with self._cleanup_on_error():
            yield hooks
        self._end_old_pass()

    @contextlib.contextmanager
    def update_pass(self) -> Iterator[list]:
        """One policy-update pass (forward and backward) over the old pass's batches."""

        def compare(i: int, new: ProbedRouting) -> None:  # as each micro-batch's forward ends
            self._stats["replayed"].add_drift(self.probe.layer_numbers, self._old[i].used, new.used, self._masks[i])

        with self._cleanup_on_error():
            yield self._start_probe(compare, with_probs=False)
        self._stop_probe(compare)

    @contextlib.contextmanager
    def after_update_pass(self, bias_before: dict[int, Tensor] | None = None) -> Iterator[list]:
        """A forward-only pass after the optimizer step: old -> updated routing. With the
        routers' expert biases from before the step (``bias_before``, layer -> bias), also
        the routing the bias change alone made (``expert_bias_effect``: updated router
        with the old biases -> with the new ones)."""

        def compare(i: int, new: ProbedRouting) -> None:  # as each micro-batch's forward ends
            old, layers = self._old[i], self.probe.layer_numbers
            # (old.probs stay on the host: the KL brings them over a layer at a time)
            old_probs = old.probs if new.probs is not None else None
            self._stats["old_vs_new"].add_drift(layers, old.natural, new.natural, self._masks[i], old_probs, new.probs)
            if (
                bias_before is not None
            ):  # (a stage without MoE layers adds its tokens' empty routing, as every group does)
                reference = new.natural if new.natural_with_reference_bias is None else new.natural_with_reference_bias
                self._stats["expert_bias_effect"].add_drift(layers, reference, new.natural, self._masks[i])

        with self._cleanup_on_error():
            yield self._start_probe(compare, reference_bias=bias_before, with_probs=self.router_kl)
        self._stop_probe(compare)

    def add_rollout_logp_mismatch(self, logprobs: Sequence[Tensor] | None, batches: Sequence[ResponseBatch]) -> None:
        """The old pass's log-probs ``[b, s-1]`` per micro-batch (``None`` off the last
        pipeline stage; every rank calls this) against each batch's ``rollout_logp`` on its
        response ``mask``: ``|difference|`` and the k3 estimate of KL(rollout || trainer)
        kept per token for :meth:`reduce` to split by routing change (how much of the
        train-inference mismatch routing explains)."""
        if self._engine is None:
            return
        values = None
        if logprobs is not None:
            values = [
                _mismatch_token_values(lp.detach() - mb.rollout_logp, mb.mask) for lp, mb in zip(logprobs, batches)
            ]
        self._add_token_values("train_vs_rollout", ("logp_mismatch", "offpolicy_kl_k3"), values)

    def add_update_tokens(
        self, tokens: Sequence[UpdateTokenFigures] | None, batches: Sequence[ResponseBatch], *, counted: bool
    ) -> None:
        """An update pass's per-token log-ratios and clipping per micro-batch (``None`` off the
        last pipeline stage; every rank calls this), on each batch's response ``mask``;
        ``counted=False`` keeps a pass out of the split (zeros: e.g. a first update, whose
        ratios are all 1, or a skipped one)."""
        values = None
        if tokens is not None:
            values = []
            for figures, mb in zip(tokens, batches):
                per_token = torch.stack([figures.log_ratio.abs() * mb.mask, figures.clipped * mb.mask, mb.mask], -1)
                values.append(per_token if counted else torch.zeros_like(per_token))
        self._add_token_values("replayed", ("log_ratio_abs", "clip_frac"), values)

    def _add_token_values(self, group: str, names: tuple[str, ...], per_position: Sequence[Tensor] | None) -> None:
        """``per_position[i]`` ``[b, s-1, C]`` (log-prob positions) in this rank's token order."""
        local = None
        if per_position is not None:
            local = []
            for i, values in enumerate(per_position):
                # position s-1 scores nothing
                values = torch.cat([values, values.new_zeros(values.shape[0], 1, values.shape[2])], dim=1)
                values = self._observed(i, self._local(values))
                # the weights (last) estimate all tokens; the values stay as they are
                weights = values[:, -1:] * self._weights[i]
                local.append(torch.cat([values[:, :-1], weights], dim=1).transpose(0, 1))
        self._stats[group].add_token_values(names, local or [None] * len(self._masks))

    def _begin_old_pass(
        self,
        batches: Sequence[MicroBatch],
        engine_indices: Sequence[Sequence[Tensor]] | None,
        engine_routed: Sequence[Tensor] | None,
    ) -> list:
        groups = STAT_GROUPS + ((ENVIRONMENT_GROUP,) if self.split_environment else ())
        self._stats = {name: RoutingStats(self.num_layers, self.num_experts) for name in groups}
        self._sample_tokens([self._local(_routing_mask(mb)) for mb in batches])
        if self.split_environment:
            environment = [self._local(_environment_mask(mb)) for mb in batches]
            self._environment_masks = [self._observed(i, m) * self._weights[i] for i, m in enumerate(environment)]
        self._engine = [list(mb) for mb in engine_indices] if engine_indices is not None else None
        self._engine_routed = (
            [self._observed(i, self._local(m)) for i, m in enumerate(engine_routed)]
            if engine_routed is not None
            else None
        )
        return self._start_probe(probs_device=torch.device("cpu"), with_probs=self.router_kl)

    def _end_old_pass(self) -> None:
        self._old = self._stop_probe()
        layers = self.probe.layer_numbers
        for i, old in enumerate(self._old):
            self._stats["load"].add_load(layers, old.used, self._masks[i])
            if self._engine is not None:
                # no MoE layer here: empty
                engine = self._observed(i, torch.stack(self._engine[i], dim=1)) if self._engine[i] else old.used
                routed = self._engine_routed[i] if self._engine_routed is not None else 1.0
                # what the trainer computed with (under r3 that is the engine's routing)
                self._stats["train_vs_rollout"].add_drift(layers, engine, old.used, self._masks[i] * routed)
                if self.split_environment:
                    self._stats[ENVIRONMENT_GROUP].add_drift(
                        layers, engine, old.used, self._environment_masks[i] * routed
                    )

    def _start_probe(
        self,
        consume: Consumer | None = None,
        probs_device: torch.device | None = None,
        reference_bias: dict[int, Tensor] | None = None,
        *,
        with_probs: bool,
    ) -> list:
        """The probe's hooks for a pass over the observed tokens; see :meth:`RouterProbe.start`."""
        self.probe.start(consume, probs_device, reference_bias, with_probs=with_probs, tokens=self._tokens)
        return [self.probe]

    def _stop_probe(self, consume: Consumer | None = None) -> list[ProbedRouting]:
        """The pass's kept routing per micro-batch. On a pipeline stage without MoE layers,
        empty routings of its tokens (kept, or handed to ``consume``), so every stage adds
        the same token flags to the statistics."""
        probed = self.probe.stop()
        if probed or self.probe.layer_numbers:
            return probed
        empty = lambda t: torch.zeros(t, 0, 0, dtype=self.probe.index_dtype, device=self._masks[0].device)  # noqa: E731
        probed = [ProbedRouting(empty(len(m)), empty(len(m)), None) for m in self._masks]
        if consume is None:
            return probed
        for i, routing in enumerate(probed):
            consume(i, routing)
        return []

    @contextlib.contextmanager
    def _cleanup_on_error(self) -> Iterator[None]:
        """A pass that raised leaves the probe off (no stats recorded)."""
        try:
            yield
        except BaseException:
            self.probe.stop()
            raise

    def release(self) -> None:
        """Drop the step's routing, masks and statistics (device memory: held until the next
        old pass otherwise, through a colocated rollout too); after :meth:`reduce`."""
        self._old, self._masks, self._environment_masks, self._engine, self._stats = [], [], [], None, {}
        self._engine_routed = None
        self._tokens, self._weights = None, []

    def reduce(self) -> dict[str, dict[str, Tensor]]:
        """Collective: every rank calls it. Groups without data are left out."""
        group = ps.get_pipeline_model_parallel_group()
        tp = ps.get_tensor_model_parallel_world_size()
        replicas = ps.get_pipeline_model_parallel_world_size() * (1 if self._config.sequence_parallel else tp)
        out = {name: stats.reduce(pipeline_group=group, replicas=replicas) for name, stats in self._stats.items()}
        return {name: m for name, m in out.items() if m}

    # ------------------------------------------------------------ helpers

    def _sample_tokens(self, masks: Sequence[Tensor]) -> None:
        """This step's observed tokens per micro-batch (``masks``: this rank's routed tokens
        that count) and the weights that make their counts estimate all tokens."""
        self._passes += 1
        if self.sample_frac >= 1:
            self._tokens, self._weights, self._masks = None, [1.0] * len(masks), list(masks)
            return
        self._tokens = [
            sampled_tokens(m, self.sample_frac, seed=self._passes * 1_000_003 + i) for i, m in enumerate(masks)
        ]
        self._weights = [float((m > 0).sum()) / max(len(t), 1) for m, t in zip(masks, self._tokens)]
        self._masks = [m[t] * w for m, t, w in zip(masks, self._tokens, self._weights)]

    def _observed(self, index: int, per_token: Tensor) -> Tensor:
        """Micro-batch ``index``'s ``[T_local, ...]`` values at its observed tokens."""
        return per_token if self._tokens is None else per_token[self._tokens[index]]

    def _local(self, per_position: Tensor) -> Tensor:
        cfg = self._config
        return to_local_tokens(
            per_position,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            sequence_parallel=cfg.sequence_parallel,
        )


def sampled_tokens(mask: Tensor, frac: float, seed: int) -> Tensor:
    """Ascending indices of ``round(frac * n)`` (at least one) of the ``n`` tokens where
    ``mask > 0``, drawn without replacement by a CPU generator seeded with ``seed``: the
    same tokens on every rank that holds the same mask."""
    valid = (mask > 0).nonzero().flatten()
    keep = min(valid.numel(), max(1, round(frac * valid.numel())))
    order = torch.randperm(valid.numel(), generator=torch.Generator().manual_seed(seed))[:keep]
    return valid[order.to(valid.device)].sort().values


class UpdateTokenFigures(Protocol):
    """What the drift metrics read of an update pass's micro-batch, ``[b, s-1]`` each (the
    objective's :class:`~moe_rl.trainer.objective.UpdateTokens`)."""

    @property
    def log_ratio(self) -> Tensor: ...  # log-prob - old log-prob

    @property
    def clipped(self) -> Tensor: ...  # 1 where the loss's objective is clipped


class ResponseBatch(Protocol):
    """What the drift metrics read of a training micro-batch (the trainer's, a
    :class:`MicroBatch` with its response mask and the engine's log-probs)."""

    input_ids: Tensor
    lengths: Tensor | None
    mask: Tensor  # [b, s-1]: 1 on the response tokens
    rollout_logp: Tensor  # [b, s-1]


def _environment_mask(mb: MicroBatch) -> Tensor:
    """Input positions holding tokens an environment inserted (``environment_tokens``; none
    when the batch has no such field or value)."""
    env = getattr(mb, "environment_tokens", None)
    return (
        env.to(torch.float32)
        if env is not None
        else torch.zeros(mb.input_ids.shape, dtype=torch.float32, device=mb.input_ids.device)
    )


def _routing_mask(mb: MicroBatch) -> Tensor:
    """Positions whose routing matters: real tokens except each sequence's last one
    (``mb.lengths``; all positions but the last when absent), on the batch's device."""
    b, s = mb.input_ids.shape
    device = mb.input_ids.device
    lengths = mb.lengths if mb.lengths is not None else torch.full((b,), s, device=device)
    positions = torch.arange(s, device=device).unsqueeze(0)
    return (positions < lengths.to(device).unsqueeze(1) - 1).to(torch.float32)
