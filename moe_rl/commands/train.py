"""``moe-rl train --config C [key=value ...]``: one RL run (one process, or every rank
under a launcher, or ``--nproc N`` local processes)."""

from __future__ import annotations

import argparse

HELP = "run RL training from a YAML config with dotted overrides"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help=HELP, description=HELP)
    p.add_argument("--config", default=None, help="YAML config (default: the built-in demo settings)")
    p.add_argument("--nproc", type=int, default=None, help="start this many local processes")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. algorithm.loss=gspo")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    from moe_rl.commands import configure_logging
    from moe_rl.commands._distributed import fail
    from moe_rl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return fail(str(e))
    if args.nproc is not None and args.nproc < 1:
        return fail(f"--nproc {args.nproc} must be >= 1")
    spawn = bool(args.nproc) and "RANK" not in os.environ
    from parallel.distributed import launch_env
    from parallel.layout import LayoutError

    try:  # fail fast: before spawning ranks or building anything (the model's checks come later)
        cfg.parallel.validate(args.nproc if spawn else launch_env().world_size)
    except LayoutError as e:
        return fail(str(e))
    if spawn:
        from parallel.launch import spawn_local

        argv = ["-m", "moe_rl.cli", "train"] + (["--config", args.config] if args.config else []) + list(args.overrides)
        return spawn_local(args.nproc, argv)
    configure_logging()
    import threading

    from moe_rl.disk import OutOfSpace, out_of_space_line, quiet_about_space

    threading.excepthook = quiet_about_space(threading.excepthook)  # (TensorBoard's writer thread, on a full disk)
    from moe_rl.rollout.types import RolloutError
    from moe_rl.trainer.trainer import TrainingStopped, train

    try:
        train(cfg)
    except (LayoutError, ConfigError) as e:
        return fail(str(e))
    except (TrainingStopped, RolloutError, OutOfSpace) as e:
        print(f"moe-rl: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:
        print(f"moe-rl: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130
    except BaseException as e:  # a full disk met elsewhere (TensorBoard's writer, the run's files)
        line = None if isinstance(e, SystemExit) else out_of_space_line(e, cfg.train.run_dir)
        if line is None:
            raise
        print(f"moe-rl: stopped: {line}", file=sys.stderr)
        return 3
    finally:
        from parallel.distributed import destroy_distributed

        destroy_distributed()
    return 0
