"""The ``moe-rl`` command line."""

from __future__ import annotations

import argparse
import sys
import warnings

import moe_rl


def _demo(_args: argparse.Namespace) -> int:
    """Placeholder for the built-in demo until the trainer lands.

    It checks the install and shows, on DESIGN.md's two-binary-reward example, the
    advantage difference that GDPO exists for.
    """
    import torch

    from moe_rl.algorithms import compute_advantages

    print("moe-rl demo: the RL trainer and the compare demo are not built yet (trainer issue).")
    print("This placeholder checks the install and runs the algorithm core once.\n")
    # two prompts, G=2, two binary rewards: summed rewards (0, 1) and (0, 2)
    rewards = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    grpo = compute_advantages("grpo", rewards, group_size=2)
    gdpo = compute_advantages("gdpo", rewards, group_size=2)
    print(f"{'sample':>6} {'rewards':>10} {'GRPO adv':>9} {'GDPO adv':>9}")
    for i, (r, a, b) in enumerate(zip(rewards.tolist(), grpo.tolist(), gdpo.tolist())):
        print(f"{i:>6} {str(tuple(int(x) for x in r)):>10} {a:>9.3f} {b:>9.3f}")
    print("\nGRPO gives both groups the same advantages; GDPO keeps them apart.")
    print(f"torch {torch.__version__}, moe_rl {moe_rl.__version__}: install OK")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-rl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"moe-rl {moe_rl.__version__}")
    # the DeepSpeed launcher passes --local_rank=N; LOCAL_RANK in the environment is used
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the built-in demo (placeholder until the trainer lands)")
    demo.set_defaults(func=_demo)
    from moe_rl.commands import compare, drift, export, parity, prepare, train

    train.add_parser(sub)
    compare.add_parser(sub)
    prepare.add_parser(sub)
    parity.add_parser(sub)
    export.add_parser(sub)
    drift.add_parser(sub)
    return parser


# harmless notices megatron-core prints on every start without Transformer Engine/Apex
_KNOWN_NOISE = (
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
    ".*full scope is deprecated.*",
    ".*all_gather_into_tensor. is deprecated.*",
    ".*reduce_scatter_tensor. is deprecated.*",
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
