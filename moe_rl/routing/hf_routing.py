"""Routing of a Hugging Face transformers MoE model, in SGLang's layout.

Used by the local rollout engine (to return ``routed_experts`` like SGLang) and by
``moe-rl drift`` on checkpoints. Layers are all hidden layers (SGLang's
``num_layers``); dense layers get experts ``0..k-1`` and are never read. The experts
are read from each router's own output (transformers' routers return
``(logits, weights, indices)``), so every routing rule (softmax, sigmoid with a bias,
group-limited) is the model's own.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor
from transformers import PreTrainedModel

from moe_rl.models.architectures import architecture_of
from moe_rl.routing.scores import router_distribution


class RouterCapture:
    """Forward hooks on a transformers MoE model's routers (``layers[l].mlp.gate``);
    :meth:`take` returns and clears what the forward passes since the last call routed."""

    def __init__(self, model: PreTrainedModel) -> None:
        cfg = model.config
        arch = architecture_of(cfg)
        self.num_layers, self.top_k = cfg.num_hidden_layers, cfg.num_experts_per_tok
        self.score_function = arch.router(cfg)["moe_router_score_function"]
        self.moe_layers = [l for l, is_moe in enumerate(arch.moe_layer_pattern(cfg)) if is_moe]
        layers = model.get_decoder().layers
        self._gates = [layers[l].mlp.gate for l in self.moe_layers]
        self._captured: dict[int, tuple[Tensor, Tensor]] = {}
        self._handles: list = []
        self.attach()

    def attach(self) -> None:
        """Hook the routers (as made: hooked), unless they are."""
        if not self._handles:
            self._handles = [gate.register_forward_hook(self._hook(l)) for l, gate in zip(self.moe_layers, self._gates)]

    @contextlib.contextmanager
    def attached(self) -> Iterator[RouterCapture]:
        """The routers hooked within (and unhooked after, if they were not before): a model
        that only sometimes needs its routing pays for the hooks only then."""
        was_attached = bool(self._handles)
        self.attach()
        try:
            yield self
        finally:
            if not was_attached:
                self.remove()

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            logits, _, indices = output
            self._captured[layer] = (logits.detach().float(), indices.detach())

        return hook

    def take(self, batch: int, positions: int, with_probs: bool = False) -> tuple[Tensor, Tensor | None]:
        """Top-k ``[batch, positions, num_layers, k]`` (and router distributions
        ``[..., E]`` when ``with_probs``) of the last forward pass."""
        if set(self._captured) != set(self.moe_layers):
            raise ValueError(f"routers of layers {sorted(self._captured)} ran, expected {self.moe_layers}")
        indices = torch.arange(self.top_k).expand(batch, positions, self.num_layers, self.top_k).clone()
        probs = None
        for layer, (logits, chosen) in sorted(self._captured.items()):
            indices[:, :, layer] = chosen.view(batch, positions, self.top_k)
            if with_probs:
                if probs is None:
                    probs = torch.zeros(batch, positions, self.num_layers, logits.shape[-1])
                probs[:, :, layer] = router_distribution(logits, self.score_function).view(batch, positions, -1)
        self._captured = {}
        return indices, probs

    def clear(self) -> None:
        """Forget what ran since the last :meth:`take` (routers called on their own)."""
        self._captured = {}

    def remove(self) -> None:
        """Unhook the routers (:meth:`attach` hooks them again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._captured = {}


@torch.no_grad()
def transformers_routing(
    model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Top-k ``[b, s, num_layers, k]`` and router distributions ``[b, s, num_layers, E]``
    of ``model`` on ``input_ids`` ``[b, s]`` (one forward pass)."""
    capture = RouterCapture(model)
    try:
        model(input_ids, attention_mask=attention_mask)
        batch, positions = input_ids.shape
        indices, probs = capture.take(batch, positions, with_probs=True)
        assert probs is not None  # (asked for)
        return indices, probs
    finally:
        capture.remove()
