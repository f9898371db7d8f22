"""The ``moe-rl`` command line."""

from __future__ import annotations

import argparse
import sys
import warnings

import moe_rl


def _demo(args: argparse.Namespace) -> int:
    """The built-in default: ``moe-rl compare --config configs/compare/demo.yaml``."""
    from pathlib import Path

    from moe_rl.commands import compare

    config = Path(args.config)
    if not config.is_file():
        print(f"moe-rl: error: {config} not found (run from the repository root, or pass --config)", file=sys.stderr)
        return 2
    # through compare's own parser: its every option gets its default
    return compare.run(build_parser().parse_args(["compare", "--config", str(config), *args.overrides]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-rl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"moe-rl {moe_rl.__version__}")
    # the DeepSpeed launcher passes --local_rank=N; LOCAL_RANK in the environment is used
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the built-in demo: compare GRPO (+R2/R3, +TIS), GSPO, GMPO, GDPO, SAPO")
    demo.add_argument("--config", default="configs/compare/demo.yaml")
    demo.add_argument("overrides", nargs="*")
    demo.set_defaults(func=_demo)
    from moe_rl.commands import budget, compare, drift, evaluate, export, parity, prepare, train

    train.add_parser(sub)
    compare.add_parser(sub)
    prepare.add_parser(sub)
    parity.add_parser(sub)
    export.add_parser(sub)
    drift.add_parser(sub)
    evaluate.add_parser(sub)
    budget.add_parser(sub)
    return parser


# harmless notices megatron-core prints on every start without Transformer Engine/Apex
_KNOWN_NOISE = (
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
    ".*full scope is deprecated.*",
    ".*all_gather_into_tensor. is deprecated.*",
    ".*reduce_scatter_tensor. is deprecated.*",
    ".*The .grad attribute of a Tensor that is not a leaf Tensor.*",
    ".*CUDA_DEVICE_MAX_CONNECTIONS.*",
)


def main(argv: list[str] | None = None) -> int:
    for pattern in _KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
