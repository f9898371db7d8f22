"""Shared plumbing of commands that run on one or many processes."""

from __future__ import annotations

import argparse
import os
import sys

from parallel.layout import LayoutError, ParallelLayout


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallel layout")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    g.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: = tp)")
    g.add_argument(
        "--first-stage-layers",
        type=int,
        default=None,
        help="decoder layers on the first pipeline stage (default: parallel.first_stage_layers' rule)",
    )
    g.add_argument("--last-stage-layers", type=int, default=None, help="decoder layers on the last pipeline stage")
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="start this many local processes (otherwise the launcher's RANK/WORLD_SIZE are used)",
    )


def layout_from(args: argparse.Namespace) -> ParallelLayout:
    return ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )


def maybe_spawn(args: argparse.Namespace, command: str) -> int | None:
    """With ``--nproc N`` outside a launcher, re-run this command in N local processes
    and return their exit code; inside a launcher (or without --nproc) return None."""
    if args.nproc is None or "RANK" in os.environ:
        return None
    world = int(args.nproc)
    if world < 1:
        raise LayoutError(f"--nproc {world} must be >= 1")
    layout_from(args).validate(world)  # fail fast, before spawning
    from parallel.launch import spawn_local

    argv = [a for a in sys.argv[1:]]
    argv = _drop_option(argv, "--nproc")
    return spawn_local(world, ["-m", "moe_rl.cli", *argv])


def _drop_option(argv: list[str], option: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == option:
            skip = True
            continue
        if a.startswith(option + "="):
            continue
        out.append(a)
    return out


def fail(message: str) -> int:
    print(f"moe-rl: error: {message}", file=sys.stderr)
    return 2


__all__ = ["LayoutError", "add_layout_args", "fail", "layout_from", "maybe_spawn"]
