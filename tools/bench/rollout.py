"""Local-engine generation throughput (tokens/s) on a tiny random MoE, CPU.

.venv/bin/python -m tools.bench.rollout [--prompts 8] [--n 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--routed", action="store_true", help="also return routed experts")
    args = p.parse_args()

    import torch

    from moe_rl.models.tiny import save_tiny_checkpoint
    from moe_rl.rollout.local import LocalEngine
    from moe_rl.rollout.types import SamplingParams

    path = save_tiny_checkpoint(tempfile.mkdtemp() + "/hf", "qwen3_moe", seed=0)
    engine = LocalEngine(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (16,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    engine.generate(prompts[:1], 2, SamplingParams(max_new_tokens=4), seed=0)  # warm-up
    engine.tokens_generated, engine.seconds_generating = 0, 0.0
    start = time.perf_counter()
    engine.generate(prompts, args.n, params, seed=1, return_routed_experts=args.routed)
    wall = time.perf_counter() - start
    print(
        f"local engine: {args.prompts} prompts x {args.n} samples, <= {args.new_tokens} new tokens, "
        f"routed_experts={'on' if args.routed else 'off'}: {engine.tokens_generated} tokens in {wall:.2f}s "
        f"= {engine.tokens_generated / wall:.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
