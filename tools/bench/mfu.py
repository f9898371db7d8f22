"""Training MFU of a model big enough to be compute-bound on this machine, and what bounds it.

    .venv/bin/python -m tools.bench.mfu [--tokens 2048] [--repeats 3] [--json FILE]

One process, a random Qwen3-MoE of 188M parameters (hidden 512, 6 layers x 16 experts
of 1024, top-4, vocab 32k; 59M active per token, the output layer included), one RL step = old-log-prob forward +
update forward/backward + Adam, as the trainer runs it under megatron-core. MFU is the
step's model FLOPs (2 x active params per token forward, 6 x for forward + backward, plus
attention) over the fp32 matmul rate measured in the same run; a torch.profiler pass
then lists where the step's time goes (the top operators by self CPU time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
SIZE = dict(
    hidden_size=512,
    moe_intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    vocab_size=32000,
)


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times) / 1e9


def param_counts(hf_config) -> tuple[float, float]:
    """(total, active per token) parameters of the HF model; the input embedding is a
    lookup, not a matmul, so it is not active (the output layer is)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    lookup = model.get_input_embeddings().weight.numel()
    return float(total), total - lookup - expert + expert * hf_config.num_experts_per_tok / hf_config.num_experts


def random_policy(lr: float = 1e-5):
    """A :class:`moe_rl.trainer.policy.Policy` of the ``SIZE`` model with random weights (only
    the arithmetic matters), with its transformer config, on one process."""
    from moe_rl.models.architectures import model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.tiny import tiny_config
    from moe_rl.trainer.policy import Policy
    from parallel.distributed import init_distributed
    from parallel.layout import ParallelLayout
    from parallel.optim import OptimSettings, build_lr_scheduler, build_optimizer, wrap_ddp

    hf_config = tiny_config("qwen3_moe", **SIZE)
    layout = ParallelLayout()
    init_distributed(layout, model_dims(hf_config))
    config = make_transformer_config(hf_config, layout)
    model = build_model(hf_config, config)
    settings = OptimSettings(lr=lr)
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    return Policy(model, ddp, optimizer, build_lr_scheduler(optimizer, settings, 10), hf_config, settings), config


def random_batches(tokens: int, seq: int = 512, device: torch.device | str = "cpu") -> list:
    """Micro-batches of 2 random sequences of ``seq`` tokens, ``tokens`` in all."""
    from moe_rl.models.forward import MicroBatch

    gen = torch.Generator().manual_seed(0)
    return [
        MicroBatch(torch.randint(0, SIZE["vocab_size"], (2, seq), generator=gen).to(device))
        for _ in range(tokens // (2 * seq))
    ]


def parse_args(doc: str, tokens: int) -> argparse.Namespace:
    """``--tokens`` (default ``tokens``), ``--repeats``, ``--json``: the options of this
    model's benchmarks."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    return parser.parse_args()


def main() -> None:
    args = parse_args(__doc__, tokens=2048)

    from moe_rl.models.forward import run_microbatches
    from parallel.optim import train_step

    policy, _ = random_policy()
    ddp, optimizer, hf_config = policy.ddp, policy.optimizer, policy.hf_config
    seq = 512
    batches = random_batches(args.tokens, seq)
    tokens = sum(mb.input_ids.numel() for mb in batches)

    def loss_fn(le, mb):
        return -le[..., 0].sum() / tokens, {}

    def step() -> None:
        with torch.no_grad():
            run_microbatches([ddp], batches)
        train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False))

    step()  # warm-up
    peak = matmul_gflops()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    total, active = param_counts(hf_config)
    attention = 4 * 3 * SIZE["num_hidden_layers"] * seq * SIZE["num_attention_heads"] * SIZE["head_dim"] * tokens
    flops = 8 * active * tokens + attention  # old pass 2N + update 6N per token, plus attention scores
    mfu = flops / seconds / (peak * 1e9)
    print(f"model: {total / 1e6:.1f}M parameters ({active / 1e6:.1f}M active per token); {tokens} tokens per step")
    print(
        f"fp32 matmul rate, same run: {peak:.0f} GFLOP/s; RL step {seconds:.2f} s = {tokens / seconds:.0f} tokens/s, MFU {mfu:.1%}"
    )

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(table)
    if args.json:
        top = [
            {"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        ]
        Path(args.json).write_text(
            json.dumps(
                {
                    "total_params": total,
                    "active_params": active,
                    "tokens": tokens,
                    "matmul_gflops": peak,
                    "step_s": seconds,
                    "mfu": mfu,
                    "top_ops": top,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
