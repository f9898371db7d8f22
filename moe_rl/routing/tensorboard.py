"""Routing metrics to TensorBoard under tags users and dashboards can rely on
(:mod:`moe_rl.tags` names them):

- ``routing/<metric>/layer_<l>`` and ``routing/<metric>/mean`` for ``changed_frac``,
  ``expert_change_frac``, ``router_kl``, ``expert_load_cv``, ``expert_load_entropy``
  (``routing/any_layer_changed_frac/mean``); engine-vs-trainer ones under
  ``routing/train_vs_rollout/<metric>/...``, with the rollout log-prob mismatch split by
  routing (``logp_mismatch``, ``logp_mismatch_routing_changed``,
  ``logp_mismatch_routing_same``, ``routing_changed_response_frac``, each ``.../mean``);
  for routers with an expert bias, what the step's bias change alone did under
  ``routing/expert_bias_effect/<metric>/...``;
- histograms ``routing/expert_load/layer_<l>`` (tokens per expert id);
- images ``routing/expert_load_heatmap`` (layers x experts) and, where two routings are
  compared, ``<group prefix>/expert_disagreement_heatmap`` (share of each layer's tokens
  for which the expert was chosen by one side only).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from moe_rl import tags  # noqa: E402

PER_LAYER = {
    "changed_frac": "drift_layers",
    "expert_change_frac": "drift_layers",
    "router_kl": "drift_layers",
    "expert_load_cv": "load_layers",
    "expert_load_entropy": "load_layers",
}
SCALARS = (
    "any_layer_changed_frac",
    "logp_mismatch",
    "logp_mismatch_routing_changed",
    "logp_mismatch_routing_same",
    "offpolicy_kl_k3",
    "offpolicy_kl_k3_routing_changed",
    "offpolicy_kl_k3_routing_same",
    "routing_changed_response_frac",
    "routing_changed_tokens",
    "routing_same_tokens",
)


def log_routing(
    writer, step: int, metrics: dict[str, Tensor], group: str = "old_vs_new", images: bool = True
) -> dict[str, float]:
    """Write ``metrics`` (from :class:`RoutingStats.reduce` or ``drift_metrics``) under
    ``group``'s tags (:data:`moe_rl.tags.ROUTING_PREFIXES`) and return the scalars
    written, by tag."""
    written: dict[str, float] = {}
    for name, layers_key in PER_LAYER.items():
        if name not in metrics:
            continue
        values = metrics[name]
        layers = metrics.get(layers_key, torch.arange(len(values)))
        for layer, value in zip(layers.tolist(), values.tolist()):
            written[tags.routing(name, group, layer)] = value
        written[tags.routing(name, group)] = float(values.mean())
    for name in SCALARS:
        if name in metrics:
            written[tags.routing(name, group)] = float(metrics[name])
    for tag, value in written.items():
        writer.add_scalar(tag, value, step)
    if "expert_disagreement" in metrics and images and float(metrics["expert_disagreement"].sum()) > 0:
        drift_layers = metrics["drift_layers"].tolist()
        fig = heatmap_figure(
            metrics["expert_disagreement"],
            drift_layers,
            "tokens routed to the expert by one side only",
            normalize=False,
        )
        writer.add_figure(tags.routing_disagreement_heatmap(group), fig, step, close=True)
    if "expert_load" in metrics:
        load = metrics["expert_load"]
        load_layers = metrics.get("load_layers", torch.arange(load.shape[0])).tolist()
        for layer, row in zip(load_layers, load):
            _load_histogram(writer, tags.routing_load_histogram(layer), row, step)
        if images:
            fig = heatmap_figure(load, load_layers)
            writer.add_figure(tags.ROUTING_HEATMAP, fig, step, close=True)
    return written


def _load_histogram(writer, tag: str, load: Tensor, step: int) -> None:
    experts = torch.arange(len(load), dtype=torch.float64)
    load = load.to(torch.float64)
    writer.add_histogram_raw(
        tag,
        min=0.0,
        max=float(len(load) - 1),
        num=float(load.sum()),
        sum=float((experts * load).sum()),
        sum_squares=float((experts**2 * load).sum()),
        bucket_limits=(experts + 0.5).tolist(),
        bucket_counts=load.tolist(),
        global_step=step,
    )


def heatmap_figure(
    load: Tensor,
    layers: Sequence[int],
    title: str = "expert load (share of layer's tokens)",
    panels: dict[str, Tensor] | None = None,
    normalize: bool = True,
):
    """A layers x experts heatmap (or several side by side: ``panels`` name -> load);
    ``normalize``: each row as shares of its sum (else the values as given)."""
    panels = panels or {title: load}
    fig, axes = plt.subplots(1, len(panels), figsize=(4 + 3 * len(panels), 1.5 + 0.35 * len(layers)), squeeze=False)
    for ax, (name, data) in zip(axes[0], panels.items()):
        share = data / data.sum(-1, keepdim=True).clamp(min=1e-12) if normalize and data.min() >= 0 else data
        im = ax.imshow(share.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_xticks(range(0, data.shape[-1], max(1, data.shape[-1] // 16)))
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig
