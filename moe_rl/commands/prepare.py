"""``moe-rl prepare --config C``: make the run's model ready (the built-in demo model is
created, warm-started and cached) without training, e.g. before parallel runs."""

from __future__ import annotations

import argparse

HELP = "prepare (and cache) the model a config uses"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help=HELP, description=HELP)
    p.add_argument("--config", default=None, help="the run's config (default: the built-in defaults)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, as for moe-rl train")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_rl.commands._distributed import fail
    from moe_rl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return fail(str(e))
    if cfg.model.hf_dir:
        print(f"model: {cfg.model.hf_dir}")
        return 0
    from moe_rl.models.demo_model import demo_model_dir, ensure_demo_model
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.peer_failure import announce_failure

    demo = cfg.demo_model()
    if (demo_model_dir(demo) / "config.json").is_file():
        print(f"model: {demo_model_dir(demo)} (cached)")
        return 0
    init_distributed(cfg.parallel)
    try:
        print(f"model: {ensure_demo_model(demo, cfg.parallel, cfg.optim.use_distributed_optimizer)} (warm-started)")
    except BaseException as e:
        announce_failure(e)  # the other ranks may be waiting for this one
        raise
    finally:
        destroy_distributed()
    return 0
