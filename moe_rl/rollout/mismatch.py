"""A simulated train-inference mismatch for the local rollout engine (``rollout.simulate_mismatch``).

At 30B scale an inference engine and a trainer disagree in two ways (R3 paper, Qwen3-30B-A3B on
SGLang vs Megatron: k3 KL ~1.5e-3 per token, ~7.5e-4 once the trainer replays the engine's
routing, about a dense model's): ~10% of router choices per layer differ, because tiny numerical
differences flip near-ties while gate values barely move, and every logit differs a little. A
tiny model in fp32 on one machine shows neither, so the engine simulates both, on its side only
(the trainer's forward is the model's own):

- **routing** (``mode=selection``, the default): each MoE layer's router picks its experts from
  its scores plus ``s_l`` times a fixed seeded function of the router's input (deterministic, as
  kernel differences are), and takes the gate values of the chosen experts from its clean logits
  by the architecture's own formula (megatron-core's routing, what the trainer recomputes for
  replayed experts). R3 therefore removes this part exactly. ``mode=weights`` perturbs the router
  weights instead (``W + s_l D_l``, ``D_l`` a seeded direction of ``W``'s norm), which moves every
  token's gate values too: R3 then replays the choice but not the rest.
- **the rest** (``logit_kl``): the engine's final logits plus ``s`` times a fixed seeded function
  of the last hidden state (unit variance per logit), where it samples and where it reports
  log-probs alike: a mismatch of the policy itself, which no replay removes.

The engine calibrates the scales itself whenever its weights change (every step), on the last
:data:`POOL_TOKENS` response tokens it generated (its first time: on a trial generation,
discarded), by :func:`~moe_rl.rollout.scale_search.solve_scale`: the routing per layer in order to
a flip fraction (``router_flip_frac``), or one scale for all layers to the KL the flips alone
cause (``routing_kl``, exact over the vocabulary; heavy-tailed per token, so the pool's mean meets
it within 25% and single batches scatter around it), then the logits' scale to their own KL
(``logit_kl``, exact, on the routing the engine uses). What it measured on what it then generated,
against its unperturbed self teacher-forced on the same tokens, is reported as
``rollout/simulated_mismatch/*``: a simulation, labelled as one. Generation for evaluation
(:meth:`MismatchSimulation.unperturbed`) uses the clean model and is neither tallied nor pooled.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import Tensor
from transformers import PreTrainedModel

from moe_rl import tags
from moe_rl.models.architectures import architecture_of
from moe_rl.routing.hf_routing import RouterCapture
from moe_rl.routing.scores import route_with_noisy_choice
from moe_rl.rollout.scale_search import MAX_MEASUREMENTS, SCALE_RANGE, solve_scale
from moe_rl.rollout.settings import SimulatedMismatch

log = logging.getLogger("moe_rl.rollout")

POOL_TOKENS = 1024  # the most recent generated tokens kept to calibrate on
# a calibrated figure within this (relative) of its target ends the search. The routing's KL is
# heavy-tailed per token: over a pool a few tokens make much of it and it jumps where one of them
# flips, and from one batch to the next it varies by more than this anyway; the logits' is smooth
FLIP_TOLERANCE, ROUTING_KL_TOLERANCE, LOGIT_KL_TOLERANCE = 0.03, 0.25, 0.03
ROUTING_KL_MEASUREMENTS = 5  # (each a forward pass over the pool) then the closest
EXTREME_LOG_RATIO = math.log(2.0)  # a token's ratio outside [1/2, 2]


@dataclass(frozen=True)
class Batch:
    """Generated tokens to calibrate on: ``rows`` ``[b, s]``, the sampling temperature, and which
    positions predict a response token (not a prompt's, nor a row's past its end)."""

    rows: Tensor
    temperature: float
    valid: Tensor  # [b, s] bool

    def positions(self, values: Tensor) -> Tensor:
        """``values`` ``[b, s, ...]`` at the positions that predict response tokens: ``[n, ...]``."""
        return values[self.valid]


def merged(batches: Sequence[Batch]) -> list[Batch]:
    """The batches of one temperature as one, their rows padded at the end (a causal model's
    outputs at a row's own positions do not depend on what follows them): one forward pass
    for the whole pool."""
    by_temperature: dict[float, list[Batch]] = {}
    for b in batches:
        by_temperature.setdefault(b.temperature, []).append(b)
    out = []
    for temperature, group in by_temperature.items():
        width = max(b.rows.shape[1] for b in group)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
        rows = torch.cat([pad(b.rows, 0) for b in group])
        out.append(Batch(rows, temperature, torch.cat([pad(b.valid, False) for b in group])))
    return out


@dataclass
class Tally:
    """What the engine measured since it was last asked, over response-predicting positions:
    per-layer flipped tokens, tokens with a flip in any layer, the k3 estimate on the drawn tokens
    and the exact KLs (engine vs clean; routing part; logit part), extreme drawn tokens."""

    flipped: Tensor  # [num_layers] tokens whose top-k set differs
    any_layer: float = 0.0
    k3_sum: float = 0.0
    kl_sum: float = 0.0
    routing_kl_sum: float = 0.0
    logit_kl_sum: float = 0.0
    extreme: float = 0.0
    tokens: int = 0


def unit_noise(inputs: Tensor, directions: Tensor) -> Tensor:
    """``[T, rows of directions]``: the inputs ``[..., H]`` scaled to unit RMS per token, times
    ``directions`` ``[N, H]`` (entries of variance ``1/H``): about unit variance per entry, a
    fixed function of each token's input."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp(min=1e-30))
    return x @ directions.T


def seeded_directions(shape: tuple[int, int], generator: torch.Generator, device: torch.device) -> Tensor:
    """A fixed random ``[N, H]`` matrix of variance ``1/H`` entries (see :func:`unit_noise`)."""
    return (torch.randn(shape, generator=generator, dtype=torch.float64) / math.sqrt(shape[1])).float().to(device)


def exact_kl(p_logits: Tensor, q_logits: Tensor, temperature: float) -> Tensor:
    """``KL(p || q)`` per position over the last dimension, at the sampling temperature."""
    log_p = torch.log_softmax(p_logits.float() / temperature, -1)
    log_q = torch.log_softmax(q_logits.float() / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class _Switched:
    """A hook that acts while ``on``; :meth:`off` turns it off for a block."""

    on = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        was, self.on = self.on, False
        try:
            yield
        finally:
            self.on = was


class RoutingNoise(Protocol):
    """A perturbation of each MoE layer's router (``gates``) by ``scales[l]``."""

    gates: dict[int, torch.nn.Module]
    scales: dict[int, float]

    def apply(self) -> None:
        """Make the routers route as ``scales`` says now."""

    def refresh(self) -> None:
        """Take the routers as they are now as the clean ones (after a weight load)."""

    def off(self) -> contextlib.AbstractContextManager[None]:
        """The clean routers for a block."""
        ...


class SelectionNoise(_Switched):
    """``mode=selection``: a forward hook on each MoE layer's router (run before any other) that
    re-chooses its experts from its scores plus ``scales[l]`` x :func:`unit_noise` of its input,
    the gate values at those experts from its clean logits (megatron-core's routing formula)."""

    def __init__(self, model: PreTrainedModel, moe_layers: list[int], generator: torch.Generator) -> None:
        cfg = model.config
        arch = architecture_of(cfg)
        self.router = arch.router(cfg)
        self.top_k = cfg.num_experts_per_tok
        layers = model.get_decoder().layers
        self.gates = {l: layers[l].mlp.gate for l in moe_layers}
        self.biased = arch.has_expert_bias(cfg)
        self.scales = {l: 0.0 for l in moe_layers}
        shape = (arch.num_experts(cfg), cfg.hidden_size)
        self._directions = {l: seeded_directions(shape, generator, model.device) for l in moe_layers}
        self._handles = [gate.register_forward_hook(self._hook(l), prepend=True) for l, gate in self.gates.items()]

    def _hook(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
            scale = self.scales[layer]
            if not self.on or scale == 0.0:
                return None  # the router's own output
            logits, weights, _ = output
            noise = scale * unit_noise(args[0], self._directions[layer])
            bias = cast(Tensor, module.e_score_correction_bias) if self.biased else None
            gates, experts = route_with_noisy_choice(logits, noise, self.top_k, self.router, bias)
            return logits, gates.to(weights.dtype), experts

        return hook

    def refresh(self) -> None:
        """Nothing to redo after a weight load: the hook reads the live router."""

    def apply(self) -> None:
        """Nothing to apply: the hook reads ``scales`` as it runs."""


class WeightNoise:
    """``mode=weights``: each MoE layer's router weight is ``W + scales[l] * D_l`` (``D_l`` a
    seeded direction of ``W``'s norm), which changes the gate values along with the choice."""

    def __init__(self, model: PreTrainedModel, moe_layers: list[int], generator: torch.Generator) -> None:
        layers = model.get_decoder().layers
        self.gates = {l: layers[l].mlp.gate for l in moe_layers}
        self.scales = {l: 0.0 for l in moe_layers}
        self._directions = {
            l: torch.randn(gate.weight.shape, generator=generator, dtype=torch.float64).to(gate.weight.device)
            for l, gate in self.gates.items()
        }
        self._clean: dict[int, Tensor] = {}
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Take the routers' current weights as the trained ones (after a weight load)."""
        for l, gate in self.gates.items():
            self._clean[l] = gate.weight.detach().clone()
            direction = self._directions[l]
            self._directions[l] = direction * (self._clean[l].double().norm() / direction.norm().clamp(min=1e-30))
        self.apply()

    @torch.no_grad()
    def apply(self) -> None:
        for l, gate in self.gates.items():
            perturbed = self._clean[l].double() + self.scales[l] * self._directions[l]
            gate.weight.copy_(perturbed.to(gate.weight.dtype))

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        with torch.no_grad():
            for l, gate in self.gates.items():
                gate.weight.copy_(self._clean[l])
        try:
            yield
        finally:
            self.apply()


class LogitNoise(_Switched):
    """A forward hook on the output layer: the logits plus ``scale`` x :func:`unit_noise` of the
    last hidden state (one seeded direction per vocabulary entry). ``captured`` keeps the last
    call's (hidden states, logits before the noise) while :meth:`capturing`."""

    def __init__(self, model: PreTrainedModel, generator: torch.Generator) -> None:
        head = model.get_output_embeddings()
        self.scale = 0.0
        self._capture = False
        self.captured: list[tuple[Tensor, Tensor]] = []
        self._directions = seeded_directions((head.weight.shape[0], head.weight.shape[1]), generator, model.device)
        self._handle = head.register_forward_hook(self._hook)

    def noise(self, hidden: Tensor) -> Tensor:
        """The unit noise ``[..., V]`` of hidden states ``[..., H]``."""
        return unit_noise(hidden, self._directions).view(*hidden.shape[:-1], -1)

    def _hook(self, module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if self._capture:
            self.captured.append((args[0].detach(), output.detach()))
        if not self.on or self.scale == 0.0:
            return None
        return output + (self.scale * self.noise(args[0])).to(output.dtype)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[tuple[Tensor, Tensor]]]:
        self._capture, self.captured = True, []
        try:
            yield self.captured
        finally:
            self._capture = False


NOISES: dict[str, Callable[[PreTrainedModel, list[int], torch.Generator], RoutingNoise]] = {
    "selection": SelectionNoise,
    "weights": WeightNoise,
}


class MismatchSimulation:
    """The engine's perturbed routing and logits, their calibration and what they did."""

    def __init__(self, model: PreTrainedModel, routers: RouterCapture, settings: SimulatedMismatch, seed: int) -> None:
        self.model, self.routers, self.settings = model, routers, settings
        generator = torch.Generator().manual_seed(seed)
        self.routing = NOISES[settings.mode](model, routers.moe_layers, generator) if settings.routes else None
        self.logits = LogitNoise(model, generator) if settings.logit_kl > 0 else None
        self.calibrated = False
        self._pool: list[Batch] = []
        self._pool_tokens: list[int] = []  # each batch's response-predicting positions
        self._tally = self._empty_tally()

    @property
    def has_samples(self) -> bool:
        """Whether it has generated tokens to calibrate on."""
        return bool(self._pool)

    def _empty_tally(self) -> Tally:
        return Tally(torch.zeros(self.routers.num_layers, dtype=torch.float64))

    def refresh(self) -> None:
        """The model's weights were just loaded: they are the trained ones; calibrate again."""
        if self.routing is not None:
            self.routing.refresh()
        self.calibrated = False

    @contextlib.contextmanager
    def unperturbed(self) -> Iterator[None]:
        """The clean model (routers and logits) for the forward passes inside."""
        with contextlib.ExitStack() as stack:
            for part in (self.routing, self.logits):
                if part is not None:
                    stack.enter_context(part.off())
            yield

    # ------------------------------------------------------------ measuring

    @torch.no_grad()
    def _forward(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k ``[b, s, L, k]`` and logits ``[b, s, V]`` of one forward pass over ``rows``."""
        logits = self.model(rows).logits.float()
        return self.routers.take(*rows.shape)[0], logits

    @torch.no_grad()
    def _router_inputs(self, noise: RoutingNoise, batches: list[Batch], layer: int) -> list[tuple]:
        """What ``layer``'s router is given in a forward pass over each batch, the routers
        before it perturbed as they are now (its own scale cannot change its input)."""
        inputs: list[tuple] = []
        handle = noise.gates[layer].register_forward_pre_hook(lambda module, args: inputs.append(args))
        try:
            for b in batches:
                self.model(b.rows)
        finally:
            handle.remove()
            self.routers.clear()
        return inputs

    @torch.no_grad()
    def _flip_rate(
        self, noise: RoutingNoise, batches: list[Batch], inputs: list[tuple], reference: list[Tensor], layer: int
    ) -> float:
        """The share of the batches' response-predicting tokens whose perturbed top-k set in
        ``layer`` differs from ``reference``: the router alone run on its ``inputs`` (what a
        whole forward pass would route there, at a fraction of its cost)."""
        flipped = tokens = 0
        gate = noise.gates[layer]
        for b, args, ref in zip(batches, inputs, reference):
            routed = gate(*args)[2].view(*b.rows.shape, -1)
            changed = changed_sets(b.positions(routed), b.positions(ref[:, :, layer]))
            flipped, tokens = flipped + int(changed.sum()), tokens + changed.numel()
        self.routers.clear()
        return flipped / max(tokens, 1)

    @torch.no_grad()
    def _routing_kl(self, batches: list[Batch], clean: list[Tensor]) -> float:
        """KL(engine routing as now, clean logits || clean model) over the batches' response-predicting positions."""
        total = count = 0.0
        with self.logits.off() if self.logits is not None else contextlib.nullcontext():
            for b, reference in zip(batches, clean):
                kl = exact_kl(b.positions(self._forward(b.rows)[1]), b.positions(reference), b.temperature)
                total, count = total + float(kl.sum()), count + kl.numel()
        return total / max(count, 1.0)

    # ------------------------------------------------------------ calibration

    def calibrate(self, prompts: Sequence[Sequence[int]], temperature: float) -> None:
        """Calibrate the routing, then the logits, on the tokens generated last (the first
        time: ``prompts``, sampled at ``temperature``)."""
        batches = merged(self._pool or [_prompt_batch(g, temperature, self.model.device) for g in _by_length(prompts)])
        with self.unperturbed():
            clean = [self._forward(b.rows) for b in batches]
        if self.routing is not None and self.settings.router_flip_frac > 0:
            self._calibrate_flips(self.routing, batches, [routing for routing, _ in clean])
        elif self.routing is not None:
            self._calibrate_routing_kl(self.routing, batches, [logits for _, logits in clean])
        if self.logits is not None:
            self._calibrate_logits(self.logits, batches)
        self.calibrated = True
        log.debug(
            "simulated mismatch: router scales %s, logit scale %s",
            {l: round(x, 4) for l, x in (self.routing.scales.items() if self.routing else ())},
            self.logits.scale if self.logits else None,
        )

    @staticmethod
    def _set_router_scale(noise: RoutingNoise, layer: int | None, scale: float) -> None:
        """One layer's scale (``None``: every layer's), applied."""
        for l in noise.scales if layer is None else (layer,):
            noise.scales[l] = scale
        noise.apply()

    def _calibrate_flips(self, noise: RoutingNoise, batches: list[Batch], reference: list[Tensor]) -> None:
        """Each MoE layer's scale (in order, the earlier ones fixed) until that layer flips at
        ``router_flip_frac``."""
        for l in list(noise.scales):
            inputs = self._router_inputs(noise, batches, l)

            def rate(scale: float, l: int = l, inputs: list = inputs) -> float:
                self._set_router_scale(noise, l, scale)
                return self._flip_rate(noise, batches, inputs, reference, l)

            found = self._solve(rate, self.settings.router_flip_frac, noise.scales[l], FLIP_TOLERANCE, 1.0)
            self._set_router_scale(noise, l, found)

    def _calibrate_routing_kl(self, noise: RoutingNoise, batches: list[Batch], clean: list[Tensor]) -> None:
        """One scale for every MoE layer, until the flips alone cost ``routing_kl``."""

        def kl(scale: float) -> float:
            self._set_router_scale(noise, None, scale)
            return self._routing_kl(batches, clean)

        last = next(iter(noise.scales.values()))
        found = self._solve(kl, self.settings.routing_kl, last, ROUTING_KL_TOLERANCE, 2.0, ROUTING_KL_MEASUREMENTS)
        self._set_router_scale(noise, None, found)

    @torch.no_grad()
    def _calibrate_logits(self, noise: LogitNoise, batches: list[Batch]) -> None:
        """The logit noise's scale until its KL, exact over the vocabulary on the engine's own
        (perturbed) routing, is ``logit_kl``: no forward pass per trial."""
        parts = []
        with noise.capturing() as captured:
            for b in batches:
                self.model(b.rows)
                hidden, logits = captured[-1]
                parts.append((b.positions(logits).float(), noise.noise(b.positions(hidden)), b.temperature))
        self.routers.clear()
        count = sum(l.shape[0] for l, _, _ in parts)

        def kl(scale: float) -> float:
            return sum(float(exact_kl(l + scale * z, l, t).sum()) for l, z, t in parts) / max(count, 1)

        noise.scale = self._solve(kl, self.settings.logit_kl, noise.scale, LOGIT_KL_TOLERANCE, 2.0)

    @staticmethod
    def _solve(
        measure: Callable[[float], float],
        target: float,
        last: float,
        tolerance: float,
        exponent: float,
        measurements: int = MAX_MEASUREMENTS,
    ) -> float:
        """:func:`~moe_rl.rollout.scale_search.solve_scale` from the last scale (the caller sets the
        scale found), warning when the target is out of reach."""
        found = solve_scale(
            measure, target, last, tolerance=tolerance, exponent=exponent, max_measurements=measurements
        )
        if not found.reached and (found.value < target) == (found.scale >= SCALE_RANGE[1]):
            log.warning(
                "simulated mismatch: a target of %.3g is out of reach (%.3g at the scale's limit %.3g)",
                target,
                found.value,
                found.scale,
            )
        return found.scale

    @torch.no_grad()
    def observe(
        self, rows: Tensor, routed: Tensor, prompt_len: int, outputs: Tensor, logprobs: Tensor, temperature: float
    ) -> None:
        """One batch the engine generated: ``rows`` ``[b, s]`` (prompt and output but the
        last token), the routing it used ``[b, s, L, k]``, the output tokens
        ``[b, s - prompt_len + 1]`` with their log-probs (``nan`` past a row's end). Tallies
        the flips and the mismatch over the positions that predict output tokens, and keeps
        the batch to calibrate on after the next weight update."""
        start = prompt_len - 1
        with self.logits.capturing() if self.logits is not None else contextlib.nullcontext() as captured:
            engine = self._forward(rows)[1][:, start:]
        routing_only = captured[-1][1][:, start:].float() if captured else engine
        with self.unperturbed():
            reference, clean = self._forward(rows)
        clean = clean[:, start:]
        valid = ~torch.isnan(logprobs)  # [b, n]
        changed = changed_sets(routed[:, start:], reference[:, start:])[valid]  # [tokens, L]
        drawn = torch.log_softmax(clean / temperature, -1).gather(-1, outputs.unsqueeze(-1)).squeeze(-1)
        log_ratio = (drawn - logprobs.to(drawn.device))[valid]
        t = self._tally
        t.flipped += changed.sum(0).double().cpu()
        t.any_layer += float(changed.any(-1).sum())
        t.k3_sum += float((torch.expm1(log_ratio) - log_ratio).sum())
        t.extreme += float((log_ratio.abs() > EXTREME_LOG_RATIO).sum())
        t.kl_sum += float(exact_kl(engine, clean, temperature)[valid].sum())
        t.routing_kl_sum += float(exact_kl(routing_only, clean, temperature)[valid].sum())
        t.logit_kl_sum += float(exact_kl(engine, routing_only, temperature)[valid].sum())
        t.tokens += changed.shape[0]
        response = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
        response[:, start:] = valid.to(rows.device)
        self._pool.append(Batch(rows, temperature, response))
        self._pool_tokens.append(changed.shape[0])
        while sum(self._pool_tokens) > POOL_TOKENS and len(self._pool) > 1:
            self._pool.pop(0)
            self._pool_tokens.pop(0)

    def take_scalars(self) -> dict[str, float]:
        """``rollout/simulated_mismatch/*`` since the last call (the targets, the scales, and
        the measured flips and KLs); empty if nothing was generated."""
        t, self._tally = self._tally, self._empty_tally()
        if not t.tokens:
            return {}
        s = self.settings
        out = {
            tags.SIMULATED_ANY_LAYER_FLIPPED_FRAC: t.any_layer / t.tokens,
            tags.SIMULATED_KL_K3: t.k3_sum / t.tokens,
            tags.SIMULATED_KL: t.kl_sum / t.tokens,
            tags.SIMULATED_ROUTING_KL: t.routing_kl_sum / t.tokens,
            tags.SIMULATED_LOGIT_KL: t.logit_kl_sum / t.tokens,
            tags.SIMULATED_EXTREME_TOKEN_FRAC: t.extreme / t.tokens,
        }
        if self.routing is not None:
            flips = {l: float(t.flipped[l]) / t.tokens for l in self.routing.scales}
            out.update({tags.simulated_mismatch("flip_frac", l): f for l, f in flips.items()})
            out.update({tags.simulated_mismatch("scale", l): x for l, x in self.routing.scales.items()})
            out[tags.simulated_mismatch("flip_frac")] = sum(flips.values()) / len(flips)
            out[tags.SIMULATED_TARGET_FLIP_FRAC if s.router_flip_frac > 0 else tags.SIMULATED_TARGET_ROUTING_KL] = (
                s.router_flip_frac or s.routing_kl
            )
        if self.logits is not None:
            out[tags.SIMULATED_TARGET_LOGIT_KL] = s.logit_kl
            out[tags.SIMULATED_LOGIT_SCALE] = self.logits.scale
        return out


def changed_sets(a: Tensor, b: Tensor) -> Tensor:
    """Whether the top-k sets differ, per token and layer (``[..., L, k]`` -> ``[..., L]``)."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1) < a.shape[-1]


def _prompt_batch(prompts: list[list[int]], temperature: float, device: torch.device) -> Batch:
    """Prompts of one length as a batch whose every position counts (a first calibration's)."""
    rows = torch.tensor(prompts, device=device)
    return Batch(rows, temperature, torch.ones(rows.shape, dtype=torch.bool, device=device))


def _by_length(prompts: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    groups: dict[int, list[list[int]]] = {}
    for p in prompts:
        groups.setdefault(len(p), []).append(list(p))
    return list(groups.values())
