"""Cost of each policy loss, forward + backward, on one [B, T] batch on this machine.

    .venv/bin/python -m tools.bench.losses [--batch 256] [--seq 4096] [--repeats 5]

Prints median milliseconds per loss and the ratio to GRPO, measured side by side in one
run (interleaved repeats, so machine noise hits every loss alike).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moe_rl.algorithms import POLICY_LOSSES, compute_advantages, policy_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    b, t = args.batch, args.seq
    old = -torch.rand(b, t, generator=gen) * 4
    logp = (old + 0.1 * torch.randn(b, t, generator=gen)).requires_grad_(True)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    adv = compute_advantages("grpo", torch.rand(b, generator=gen), args.group_size)

    names = POLICY_LOSSES.names()
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        policy_loss(name, logp, old, adv, mask)[0].backward()
    for _ in range(args.repeats):
        for name in names:
            logp.grad = None
            start = time.perf_counter()
            loss, _ = policy_loss(name, logp, old, adv, mask)
            loss.backward()
            times[name].append(time.perf_counter() - start)

    print(
        f"policy loss forward+backward, [{b}, {t}] float32, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'loss':<14}{'ms':>10}{'x grpo':>9}{'Mtok/s':>9}")
    base = statistics.median(times["grpo"])
    rows = {}
    for name in names:
        med = statistics.median(times[name])
        rows[name] = {"ms": med * 1e3, "ratio_to_grpo": med / base, "mtok_per_s": mask.sum().item() / med / 1e6}
        print(f"{name:<14}{med * 1e3:>10.1f}{med / base:>9.2f}{rows[name]['mtok_per_s']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [b, t], "threads": torch.get_num_threads(), "losses": rows}, f, indent=2)


if __name__ == "__main__":
    main()
