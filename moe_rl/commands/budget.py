"""``moe-rl budget --config C --world N [--hf-config FILE]``: the static GPU memory per
training rank of a config's model and parallel layout, and what a checkpoint save adds, per
pipeline stage (:mod:`moe_rl.models.memory_budget`; nothing is built or loaded)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_rl.models.memory_budget import Layout

HELP = "static GPU memory per rank (weights, gradients, optimizer) and a save's, for a config's layout"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("budget", help=HELP, description=HELP)
    p.add_argument("--config", required=True, help="a moe-rl YAML config (parallel, optim, model.hf_dir)")
    p.add_argument("--world", type=int, required=True, help="training ranks (GPUs)")
    p.add_argument("--hf-config", help="the model's config.json (default: model.hf_dir/config.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_rl.commands._distributed import fail
    from moe_rl.config import ConfigError

    try:
        layout, hf_config = budget_inputs(args.config, args.world, args.hf_config)
    except ConfigError as e:
        return fail(str(e))
    from moe_rl.models.memory_budget import count_params, layer_params, save_budget, stage_budget

    counts, layers = count_params(hf_config), layer_params(hf_config)
    total = counts.total
    print(
        f"{args.config}: {total / 1e9:.2f}B parameters ({counts.layers_expert / 1e9:.2f}B in routed experts); "
        f"world {layout.world}, tp {layout.tp} pp {layout.pp} ep {layout.ep} etp {layout.etp}, dp {layout.dp}, "
        f"expert dp {layout.expert_dp}, distributed optimizer {'on' if layout.distributed_optimizer else 'off'}"
    )
    for stage, stage_layers in enumerate(layout.stage_layers(len(layers))):
        b = stage_budget(counts, layout, stage, layers)
        print(
            f"  stage {stage} ({stage_layers} layers): {b['params_B']:.2f}B params per rank: weights "
            f"{b['weights_GB']:.1f} GB + grads {b['grads_GB']:.1f} GB + master/Adam {b['optimizer_GB']:.1f} GB = "
            f"{b['total_GB']:.1f} GB static per GPU"
        )
        for reshardable, kind in ((True, "fully_reshardable"), (False, "dp_reshardable")):
            s = save_budget(counts, layout, stage, layers, reshardable=reshardable)
            gathered = (
                f"DP-gathered optimizer state {s['gathered_GB']:.1f} GB + " if s["gathered_GB"] else "no gather, "
            )
            print(
                f"    save, train.checkpoint_reshardable={str(reshardable).lower()} ({kind}): host peak "
                f"{s['host_peak_GB']:.1f} GB per rank ({gathered}staged {s['staged_GB']:.1f} GB, held until the "
                f"writer is done); GPU {s['gpu_transient_GB']:.1f} GB transient"
            )
    return 0


def budget_inputs(config: str, world: int, hf_config_path: str | None) -> tuple[Layout, dict]:
    """The layout of ``config`` on ``world`` ranks and the model's config.json mapping, both
    checked as the trainer checks them (:class:`~moe_rl.config.ConfigError` naming the first
    problem). The config is read without the checks of files and data that planning
    precedes (``model.hf_dir`` need only hold the config.json, or ``--hf-config`` name it)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from moe_rl.config import ConfigError, parse_config
    from moe_rl.models.architectures import model_dims
    from moe_rl.models.memory_budget import layout_of
    from parallel.layout import LayoutError

    cfg = parse_config(config)
    if hf_config_path is None and not cfg.model.hf_dir:
        raise ConfigError(f"{config} names no model.hf_dir (the built-in demo model): pass --hf-config")
    hf_path = Path(hf_config_path or Path(cfg.model.hf_dir or "") / "config.json")
    try:
        hf_config = json.loads(hf_path.read_text())
        model = AutoConfig.for_model(**hf_config)
    except (OSError, ValueError, TypeError) as e:
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        fix = "give an HF config.json" if hf_config_path else "pass --hf-config"
        raise ConfigError(f"cannot read the model's config {hf_path} ({why}): {fix}") from None
    try:
        cfg.optim.validate()
        cfg.parallel.validate(world, model_dims(model))
    except (LayoutError, ValueError) as e:
        raise ConfigError(f"{config} on --world {world}: {e}") from None
    return layout_of(cfg.parallel, cfg.optim, world), hf_config
