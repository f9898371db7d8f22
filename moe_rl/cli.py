"""The ``moe-rl`` command line."""

from __future__ import annotations

import argparse
import sys
import warnings

import moe_rl

DESCRIPTION = "moe-rl: RL post-training for Mixture-of-Experts models (megatron-core training, SGLang rollouts)."
EXAMPLES = """examples:
  moe-rl demo                                      the built-in comparison (a few minutes on CPU)
  moe-rl train --config configs/algorithms/gspo.yaml train.steps=50
  moe-rl compare --config configs/compare/demo.yaml --only grpo,grpo_r3
  moe-rl COMMAND --help                            each command's options
docs: README.md and docs/ in the repository"""


def _demo(args: argparse.Namespace) -> int:
    """The built-in default: ``moe-rl compare`` on ``configs/compare/demo.yaml``."""
    from pathlib import Path

    from moe_rl.commands import compare

    if not Path(args.config).is_file():
        print(
            f"moe-rl: error: {args.config} not found (run from the repository root, or pass --config)", file=sys.stderr
        )
        return 2
    return compare.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-rl", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"moe-rl {moe_rl.__version__}")
    # the DeepSpeed launcher passes --local_rank=N; LOCAL_RANK in the environment is used
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from moe_rl.commands import budget, compare, drift, evaluate, export, parity, prepare, train

    demo_help = "run the built-in demo: compare GRPO (+R2/R3, +TIS), GSPO, GMPO, GDPO, SAPO"
    demo = sub.add_parser("demo", help=demo_help, description=demo_help + " (moe-rl compare on its default config)")
    compare.add_arguments(demo)
    demo.set_defaults(func=_demo)

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
    ".*`load_state_dict` is deprecated.*",  # torch's, called by megatron's checkpoint loader
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
