"""Observe each MoE layer's routing during a forward pass, per micro-batch.

For every router on this rank a forward hook records, for the tokens it routes:
``natural`` top-k (what the live router would choose, bias and groups included, even
when replay forces other experts), ``used`` top-k (what the layer actually dispatched
to: the router's routing map) and, when a pass asks for it, the router's distribution
over experts ``probs`` (:func:`moe_rl.routing.scores.router_distribution`).
Tensors are ``[T, L_local, ...]`` in megatron's token order for this rank, or of the
tokens a pass selects per micro-batch; expert indices are kept in
:func:`moe_rl.routing.encoding.expert_index_dtype`. Only a micro-batch's own forward is
observed: activation recompute re-runs a router in the backward, outside it (under
pipeline parallelism after later micro-batches' forwards), and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
import torch.nn.functional as F
from torch import Tensor

from moe_rl.routing.encoding import expert_index_dtype
from moe_rl.routing.replay import moe_layers
from moe_rl.routing.scores import chosen_experts, natural_topk, router_distribution


@dataclass
class ProbedRouting:
    natural: Tensor  # [T, L, k] expert_index_dtype
    used: Tensor  # [T, L, k] expert_index_dtype
    probs: Tensor | None  # [T, L, E] float32, when the pass asked for them
    natural_with_reference_bias: Tensor | None = None  # [T, L, k]: the live router with other expert biases


Consumer = Callable[[int, "ProbedRouting"], None]  # (micro-batch index, its routing)


class RouterProbe:
    """Forward hooks on this rank's routers; use as ``run_microbatches`` hooks. A pass
    either keeps every micro-batch's routing (:meth:`stop` returns them) or hands each to
    a consumer as soon as its forward ends, keeping none (memory of one micro-batch)."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = moe_layers(model)
        self.layer_numbers = [n for n, _ in layers]
        self.top_k = layers[0][1].topk if layers else 0
        self.index_dtype = expert_index_dtype(layers[0][1].config.num_moe_experts) if layers else torch.uint8
        self.with_probs = True
        self.enabled = False
        self._current: list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]] = []
        self.captured: dict[int, ProbedRouting] = {}
        self._consume: Consumer | None = None
        self._probs_device: torch.device | None = None
        self._reference_bias: dict[int, Tensor] = {}
        self._tokens: Sequence[Tensor | None] | None = None
        self._in_forward = False  # between before_forward and after_forward of one micro-batch
        self._tokens_now: Tensor | None = None  # that micro-batch's observed tokens (None: all)
        self._layer_of = {id(router): n for n, router in layers}
        self._handles = [router.register_forward_hook(self._hook) for _, router in layers]

    def _hook(self, router: TopKRouter, args: tuple, output: tuple) -> None:
        if not self.enabled or not self._in_forward:  # e.g. activation recompute in a backward
            return
        with torch.no_grad():
            hidden, routing_map = args[0].reshape(-1, args[0].shape[-1]), output[1]
            if self._tokens_now is not None:
                hidden, routing_map = hidden[self._tokens_now], routing_map[self._tokens_now]
            logits = F.linear(hidden.float(), router.weight.float())
            natural = natural_topk(logits, router.config, router.expert_bias).to(self.index_dtype)
            used = chosen_experts(routing_map, self.top_k).to(self.index_dtype)
            probs = router_distribution(logits, router.config.moe_router_score_function) if self.with_probs else None
            reference_bias = self._reference_bias.get(self._layer_of[id(router)])
            with_reference = (
                None
                if reference_bias is None
                else natural_topk(logits, router.config, reference_bias).to(self.index_dtype)
            )
        self._current.append((natural, used, probs, with_reference))

    def before_forward(self, index: int, num_tokens: int) -> None:
        self._current, self._in_forward = [], True
        self._tokens_now = self._tokens[index] if self._tokens is not None else None

    def after_forward(self, index: int) -> None:
        self._in_forward, self._tokens_now = False, None
        if not self.enabled or not self._current:
            return
        natural, used, probs, with_reference = zip(*self._current)
        routing = ProbedRouting(
            natural=torch.stack(natural, dim=1),
            used=torch.stack(used, dim=1),
            probs=torch.stack(probs, dim=1) if self.with_probs else None,
            natural_with_reference_bias=torch.stack(with_reference, dim=1) if self._reference_bias else None,
        )
        self._current = []
        if self._consume is not None:
            self._consume(index, routing)
            return
        if self._probs_device is not None and routing.probs is not None:
            routing.probs = _moved(routing.probs, self._probs_device)
        self.captured[index] = routing

    def start(
        self,
        consume: Consumer | None = None,
        probs_device: torch.device | None = None,
        reference_bias: dict[int, Tensor] | None = None,
        *,
        with_probs: bool = True,
        tokens: Sequence[Tensor | None] | None = None,
    ) -> None:
        """Capture a pass: hand each micro-batch's routing to ``consume``, or keep them
        (the router distributions on ``probs_device`` when given, e.g. off the GPU).
        ``reference_bias`` (layer -> expert bias, for every router with a bias): also the
        choice the live router would make with those biases instead of its own.
        ``with_probs``: also the router distributions (only router KL needs them).
        ``tokens[i]``: the indices of micro-batch i's routed tokens to observe (``None``:
        all of them); the others cost nothing."""
        self.captured, self.enabled = {}, True
        self._consume, self._probs_device = consume, probs_device
        self._reference_bias = reference_bias or {}
        self.with_probs, self._tokens, self._tokens_now, self._in_forward = with_probs, tokens, None, False

    def stop(self) -> list[ProbedRouting]:
        """The kept routings in micro-batch order (none when a consumer took them)."""
        self.enabled, self._consume, self._reference_bias, self._tokens = False, None, {}, None
        self._in_forward, self._tokens_now, self._current = False, None, []
        return [self.captured[i] for i in sorted(self.captured)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _moved(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. Off an accelerator, into (pinned) host memory without waiting:
    nothing on the host reads it, and the stream runs the copy before any copy back."""
    if device.type != "cpu" or t.device.type == "cpu":
        return t.to(device)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return host
