"""A simulated train-inference mismatch for the local rollout engine (``rollout.simulate_mismatch``).

At 30B scale an inference engine's kernels and precision route ~10% of tokens to another
top-k set per layer than the trainer does (R3 paper, Qwen3-30B-A3B on SGLang vs Megatron);
a tiny model in fp32 on one machine routes ~0.2% differently. To study that regime here the
engine's routers get ``W + s_l * D_l`` instead of the trained ``W`` (``D_l`` a fixed random
direction of ``W``'s norm, seeded): a deterministic function of the router's input, as
kernel and precision differences are, that changes the engine's expert choices and therefore
its log-probs, while the trainer's forward is untouched. What the engine routed is what it
reports, so R3 replays exactly the perturbed choice.

The engine calibrates ``s_l`` itself, whenever its weights change (every step): by bisection
per layer, in order, on the tokens it generated last (its first time: on a trial generation,
discarded), so
that the tokens that predict responses get another top-k set than under the unperturbed
model at the target rate. The figures it measured on what it then generated (its routing
against the unperturbed model's, teacher-forced on the same tokens) are reported as
``rollout/simulated_mismatch/*``: a simulation, labelled as one.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl import tags
from moe_rl.routing.hf_routing import RouterCapture

log = logging.getLogger("moe_rl.rollout")

BISECTION_STEPS = 8  # within a bracket of 9x around the last scale: ~1% of the scale
WIDE_BISECTION_STEPS = 14
SCALE_RANGE = (1e-4, 4.0)  # the perturbation's norm relative to the router weight's
BRACKET = 3.0  # the last scale / 3 .. x 3
POOL_TOKENS = 2048  # the most recent generated tokens kept to calibrate on


@dataclass
class FlipTally:
    """What the engine measured since it was last asked: per-layer flipped tokens, tokens with
    a flip in any layer, and the k3 estimate of KL(engine || unperturbed model)."""

    flipped: Tensor  # [num_layers] tokens whose top-k set differs
    any_layer: float = 0.0
    k3_sum: float = 0.0
    tokens: int = 0

    def add(self, changed: Tensor, k3: Tensor) -> None:
        self.flipped += changed.sum(0).double()
        self.any_layer += float(changed.any(-1).sum())
        self.k3_sum += float(k3.sum())
        self.tokens += changed.shape[0]


@dataclass
class RouterPerturbation:
    """The engine's perturbed routers, their calibration and what they did."""

    model: torch.nn.Module
    routers: RouterCapture
    target: float
    seed: int
    scales: dict[int, float] = field(default_factory=dict)
    calibrated: bool = False

    def __post_init__(self) -> None:
        layers = self.model.get_decoder().layers
        self._gates = {l: layers[l].mlp.gate for l in self.routers.moe_layers}
        generator = torch.Generator().manual_seed(self.seed)
        self._directions = {
            l: torch.randn(gate.weight.shape, generator=generator, dtype=torch.float64)
            for l, gate in self._gates.items()
        }
        self._clean: dict[int, Tensor] = {}
        self.scales = {l: 0.0 for l in self._gates}
        self._pool: list[tuple[Tensor, int]] = []  # (rows [b, s], first position that predicts a response token)
        self._tally = self._empty_tally()
        self.refresh()

    @property
    def has_samples(self) -> bool:
        """Whether it has generated tokens to calibrate on."""
        return bool(self._pool)

    def _empty_tally(self) -> FlipTally:
        return FlipTally(torch.zeros(self.routers.num_layers, dtype=torch.float64))

    # ------------------------------------------------------------ weights

    @torch.no_grad()
    def refresh(self) -> None:
        """Take the routers' current weights as the trained ones (after a weight load) and
        perturb them again."""
        for l, gate in self._gates.items():
            self._clean[l] = gate.weight.detach().clone()
            direction = self._directions[l]
            self._directions[l] = direction * (self._clean[l].double().norm() / direction.norm().clamp(min=1e-30))
        self._apply()
        self.calibrated = False  # for these weights

    @torch.no_grad()
    def _apply(self) -> None:
        for l, gate in self._gates.items():
            perturbed = self._clean[l].double() + self.scales[l] * self._directions[l]
            gate.weight.copy_(perturbed.to(gate.weight.dtype))

    @contextlib.contextmanager
    def unperturbed(self) -> Iterator[None]:
        """The trained routers for the forward passes inside."""
        with torch.no_grad():
            for l, gate in self._gates.items():
                gate.weight.copy_(self._clean[l])
        try:
            yield
        finally:
            self._apply()

    # ------------------------------------------------------------ measuring

    @torch.no_grad()
    def _routing(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k ``[b, s, L, k]`` and logits ``[b, s, V]`` of one forward pass over ``rows``."""
        logits = self.model(rows).logits.float()
        return self.routers.take(*rows.shape)[0], logits

    @torch.no_grad()
    def _router_inputs(self, batches: list[tuple[Tensor, int]], layer: int) -> list[tuple]:
        """What ``layer``'s router is given in a forward pass over each batch, the routers
        before it perturbed as they are now (its own scale cannot change its input)."""
        inputs: list[tuple] = []
        handle = self._gates[layer].register_forward_pre_hook(lambda module, args: inputs.append(args))
        try:
            for rows, _ in batches:
                self.model(rows)
        finally:
            handle.remove()
            self.routers.clear()
        return inputs

    @torch.no_grad()
    def _flip_rate(
        self, batches: list[tuple[Tensor, int]], inputs: list[tuple], reference: list[Tensor], layer: int
    ) -> float:
        """The share of the batches' response-predicting tokens whose perturbed top-k set in
        ``layer`` differs from ``reference``: the router alone run on its ``inputs`` (what a
        whole forward pass would route there, at a fraction of its cost)."""
        flipped = tokens = 0
        gate = self._gates[layer]
        for (rows, start), args, ref in zip(batches, inputs, reference):
            routed = gate(*args)[2].view(*rows.shape, -1)
            changed = _changed(routed[:, start:], ref[:, start:, layer])
            flipped, tokens = flipped + int(changed.sum()), tokens + changed.numel()
        self.routers.clear()
        return flipped / max(tokens, 1)

    # ------------------------------------------------------------ calibration

    def calibrate(self, prompts: Sequence[Sequence[int]]) -> None:
        """Bisect each MoE layer's scale (in order, the earlier ones fixed) until the tokens
        generated last (the first time: ``prompts``) flip in that layer at the target rate."""
        batches = self._pool or [(torch.tensor(g, device=self.model.device), 0) for g in _by_length(prompts)]
        with self.unperturbed():
            reference = [self._routing(rows)[0] for rows, _ in batches]
        for l in self._gates:
            self._apply()  # the layers before it at their calibrated scales
            inputs = self._router_inputs(batches, l)
            last = self.scales[l]
            found = None
            if last > 0:  # near the last scale; the target outside that bracket: over the whole range
                found = self._bisect(l, batches, inputs, reference, last / BRACKET, last * BRACKET, BISECTION_STEPS)
            if found is None:
                found = self._bisect(l, batches, inputs, reference, *SCALE_RANGE, WIDE_BISECTION_STEPS)
            self.scales[l] = SCALE_RANGE[1] if found is None else found
        self._apply()
        self.calibrated = True
        log.debug("simulated mismatch: router perturbation scales %s", {l: round(x, 4) for l, x in self.scales.items()})

    def _bisect(
        self,
        layer: int,
        batches: list[tuple[Tensor, int]],
        inputs: list[tuple],
        reference: list[Tensor],
        lo: float,
        hi: float,
        steps: int,
    ) -> float | None:
        """The scale in [lo, hi] (bisected in log space) at which ``layer`` flips at the
        target rate; ``None`` when the target lies outside (the bracket never narrowed from
        one side)."""
        lo, hi = math.log(lo), math.log(hi)
        moved_lo = moved_hi = False
        for _ in range(steps):
            mid = (lo + hi) / 2
            self.scales[layer] = math.exp(mid)
            self._apply()
            if self._flip_rate(batches, inputs, reference, layer) < self.target:
                lo, moved_lo = mid, True
            else:
                hi, moved_hi = mid, True
        return math.exp((lo + hi) / 2) if moved_lo and moved_hi else None

    @torch.no_grad()
    def observe(
        self, rows: Tensor, routed: Tensor, prompt_len: int, outputs: Tensor, logprobs: Tensor, temperature: float
    ) -> None:
        """One batch the engine generated: ``rows`` ``[b, s]`` (prompt and output but the
        last token), the perturbed routing it used ``[b, s, L, k]``, the output tokens
        ``[b, s - prompt_len + 1]`` with their log-probs (``nan`` past a row's end). Tallies
        the flips and the log-prob mismatch over the positions that predict output tokens,
        and keeps the batch to calibrate on after the next weight update."""
        with self.unperturbed():
            reference, logits = self._routing(rows)
        start = prompt_len - 1
        valid = ~torch.isnan(logprobs)  # [b, n]
        changed = _changed(routed[:, start:], reference[:, start:])  # [b, n, L]
        clean = torch.log_softmax(logits[:, start:] / temperature, -1).gather(-1, outputs.unsqueeze(-1)).squeeze(-1)
        log_ratio = (clean - logprobs.to(clean.device))[valid]
        self._tally.add(changed[valid], torch.expm1(log_ratio) - log_ratio)
        self._pool.append((rows, start))
        while sum(r.numel() for r, _ in self._pool) > POOL_TOKENS and len(self._pool) > 1:
            self._pool.pop(0)

    def take_scalars(self) -> dict[str, float]:
        """``rollout/simulated_mismatch/*`` since the last call (the target, the scales, and
        the measured flips and KL); empty if nothing was generated."""
        tally, self._tally = self._tally, self._empty_tally()
        if not tally.tokens:
            return {}
        flips = {l: float(tally.flipped[l]) / tally.tokens for l in self._gates}
        return {
            tags.SIMULATED_TARGET_FLIP_FRAC: self.target,
            **{tags.simulated_mismatch("flip_frac", l): f for l, f in flips.items()},
            tags.simulated_mismatch("flip_frac"): sum(flips.values()) / len(flips),
            **{tags.simulated_mismatch("scale", l): s for l, s in self.scales.items()},
            tags.SIMULATED_ANY_LAYER_FLIPPED_FRAC: tally.any_layer / tally.tokens,
            tags.SIMULATED_KL_K3: tally.k3_sum / tally.tokens,
        }


def _changed(a: Tensor, b: Tensor) -> Tensor:
    """Whether the top-k sets differ, per token and layer (``[..., L, k]`` -> ``[..., L]``)."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1) < a.shape[-1]


def _by_length(prompts: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    groups: dict[int, list[list[int]]] = {}
    for p in prompts:
        groups.setdefault(len(p), []).append(list(p))
    return list(groups.values())
