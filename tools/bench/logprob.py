"""Peak memory and time of per-token log-probs + entropy, forward and backward, for a
large vocabulary: moe-rl's chunked path vs naive full-logits log_softmax + gather.
Each variant runs in a fresh process (peak RSS = ru_maxrss); prints JSON.

    python -m tools.bench.logprob --variant chunked|naive [--vocab 151936] [--seq 4096] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=["chunked", "naive", "baseline"], required=True)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=512)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.seq, args.batch, args.hidden, generator=gen).requires_grad_(True)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.seq, args.batch), generator=gen)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if args.variant == "chunked":
        from moe_rl.models.logprob_head import LogProbConfig, vocab_parallel_logprobs

        logp, entropy = vocab_parallel_logprobs(hidden, weight, targets, config=LogProbConfig(chunk_size=args.chunk))
    elif args.variant == "naive":
        logits = hidden @ weight.t()
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    else:  # inputs only: the floor both variants share
        logp = entropy = hidden.sum(-1)
    (logp.sum() + entropy.sum()).backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        "BENCH_JSON "
        + json.dumps(
            {
                "variant": args.variant,
                "seconds": elapsed,
                "peak_rss_mib": peak / 1024,
                "growth_mib": (peak - before) / 1024,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
