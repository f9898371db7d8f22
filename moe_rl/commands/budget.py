"""``moe-rl budget --config C --world N [--hf-config FILE]``: the static GPU memory per
training rank of a config's model and parallel layout, and what a checkpoint save adds, per
pipeline stage (:mod:`moe_rl.models.memory_budget`; nothing is built or loaded)."""

from __future__ import annotations

import argparse

HELP = "static GPU memory per rank (weights, gradients, optimizer) and a save's, for a config's layout"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("budget", help=HELP, description=HELP)
    p.add_argument("--config", required=True, help="a moe-rl YAML config (parallel, optim, model.hf_dir)")
    p.add_argument("--world", type=int, required=True, help="training ranks (GPUs)")
    p.add_argument("--hf-config", help="the model's config.json (default: model.hf_dir/config.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from moe_rl.commands._distributed import fail
    from moe_rl.models.memory_budget import count_params, layer_params, layout_from_config, save_budget, stage_budget

    try:
        layout, hf_dir = layout_from_config(args.config, args.world)
    except (OSError, ValueError) as e:
        return fail(str(e))
    hf_path = Path(args.hf_config or Path(hf_dir) / "config.json")
    try:
        hf_config = json.loads(hf_path.read_text())
    except (OSError, ValueError) as e:
        return fail(f"cannot read the model's config {hf_path} ({getattr(e, 'strerror', None) or e}): pass --hf-config")
    counts, layers = count_params(hf_config), layer_params(hf_config)
    total = sum(vars(counts).values())
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
