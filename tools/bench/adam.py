"""megatron-core's Adam step with torch's fused AdamW kernel (``optim.fused_adam=true``, the
default) against its multi-tensor form (false, the previous default on CPU), side by side.

    .venv/bin/python -m tools.bench.adam [--repeats 5] [--json FILE]

One process, the random 188M-parameter Qwen3-MoE of ``tools/bench/mfu.py`` (no Transformer
Engine / apex here, so megatron-core steps with torch's AdamW). One update fills the
gradients; then ``optimizer.step()`` is timed with each kernel in turns (the same
optimizer and gradients, the kernel switched between turns), median per kernel.
Prints the figures and ``BENCH_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="turns per kernel")
    parser.add_argument("--json")
    args = parser.parse_args()

    from tools.bench.mfu import random_batches, random_policy

    from moe_rl.models.forward import run_microbatches
    from parallel.optim import choose_adam_kernel, train_step

    policy, _ = random_policy()
    ddp, optimizer = policy.ddp, policy.optimizer
    params = sum(p.numel() for p in policy.model.parameters())
    batches = random_batches(1024)

    def loss_fn(out, mb):
        loss = -out[..., 0].mean()
        return loss, {}

    train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False))
    times: dict[str, list[float]] = {"fused": [], "foreach": []}
    for turn in range(args.repeats):
        for kernel in ("fused", "foreach") if turn % 2 == 0 else ("foreach", "fused"):
            choose_adam_kernel(optimizer, fused=kernel == "fused")
            optimizer.step()  # warm: this kernel's first step after a switch
            start = time.perf_counter()
            optimizer.step()
            times[kernel].append(time.perf_counter() - start)
    result = {
        "params": params,
        "fused_step_s": statistics.median(times["fused"]),
        "foreach_step_s": statistics.median(times["foreach"]),
        "turns": {k: [round(t, 4) for t in v] for k, v in times.items()},
    }
    result["time_ratio_fused_over_foreach"] = result["fused_step_s"] / result["foreach_step_s"]
    print(
        f"Adam step, {params / 1e6:.0f}M fp32 parameters: fused {result['fused_step_s']:.3f}s vs foreach "
        f"{result['foreach_step_s']:.3f}s = {result['time_ratio_fused_over_foreach']:.2f}x (median of {args.repeats} turns)"
    )
    print("BENCH_JSON " + json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
