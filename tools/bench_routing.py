"""Per-step cost of routing replay and of the routing-drift metrics, side by side.

    .venv/bin/python tools/bench_routing.py [--repeats 5] [--json FILE]

One process, a small random Qwen3-MoE, one RL step = old-log-prob pass (forward) +
policy update (forward + backward, 2 micro-batches) + Adam step. Variants run
interleaved, each repeat in turn, so machine noise hits all alike; reported as median
step time and the ratio to the plain step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")


class _NoMonitor:
    """The plain step's stand-in for a RoutingMonitor: passes without hooks."""

    def old_pass(self, batches, engine_routing=None):
        return contextlib.nullcontext([])

    def update_pass(self):
        return contextlib.nullcontext([])

    def after_update_pass(self):
        return contextlib.nullcontext([])

    def reduce(self) -> dict:
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl.models.architectures import load_hf_config, model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights
    from moe_rl.models.tiny import save_tiny_checkpoint
    from moe_rl.routing.hf_routing import transformers_routing
    from moe_rl.routing.monitor import RoutingMonitor
    from moe_rl.routing.replay import replay_config_overrides
    from parallel.distributed import init_distributed
    from parallel.layout import ParallelLayout
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    size = dict(hidden_size=128, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=16, num_experts=16, num_experts_per_tok=4, vocab_size=512)
    hf_dir = save_tiny_checkpoint(tempfile.mkdtemp() + "/hf", "qwen3_moe", seed=0, **size)
    hf_config = load_hf_config(hf_dir)
    layout = ParallelLayout()
    init_distributed(layout, model_dims(hf_config))
    gen = torch.Generator().manual_seed(0)
    batches = [MicroBatch(torch.randint(0, 512, (4, 128), generator=gen)) for _ in range(2)]
    tokens = sum(mb.input_ids.numel() for mb in batches)
    from transformers import AutoModelForCausalLM

    engine = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    engine_routing = [[r[:-1] for r in transformers_routing(engine, mb.input_ids)[0]] for mb in batches]

    def loss_fn(le, mb):
        return -le[..., 0].sum() / tokens, {}

    variants = {
        "plain": ("none", False, False),
        "r2": ("r2", False, False),
        "r3": ("r3", False, False),
        "drift metrics": ("none", True, False),
        "drift + after-update pass": ("none", True, True),
    }
    steps = {}
    for name, (mode, drift, after) in variants.items():
        RouterReplay.clear_global_router_replay_instances()
        config = make_transformer_config(hf_config, layout, **replay_config_overrides(mode))
        model = build_model(hf_config, config)
        load_hf_weights(model, hf_config, hf_dir)
        settings = OptimSettings(lr=1e-5)
        ddp = wrap_ddp(model, config, settings)
        optimizer = build_optimizer([ddp], settings)
        monitor = (
            RoutingMonitor(model, mode, hf_config.num_hidden_layers, hf_config.num_experts, measure=drift)
            if (mode != "none" or drift) else None
        )  # fmt: skip
        passes = monitor or _NoMonitor()

        def step(ddp=ddp, optimizer=optimizer, passes=passes, drift=drift, after=after):
            with passes.old_pass(batches, engine_routing) as hooks:
                run_microbatches([ddp], batches, hooks=hooks)
            with passes.update_pass() as hooks:
                train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False, hooks=hooks))
            if after:
                with passes.after_update_pass() as hooks:
                    run_microbatches([ddp], batches, hooks=hooks)
            if drift:
                passes.reduce()

        step()  # warm-up
        steps[name] = step
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print(f"RL step (old-log-prob pass + update + Adam), {tokens} tokens, {hf_config.num_hidden_layers} MoE layers x "
          f"{hf_config.num_experts} experts (top-{hf_config.num_experts_per_tok}), 1 CPU process, median of {args.repeats}")
    print(f"{'variant':<28}{'ms/step':>10}{'x plain':>9}")
    rows = {}
    for name in variants:
        med = statistics.median(times[name])
        rows[name] = {"ms": med * 1e3, "ratio": med / base}
        print(f"{name:<28}{med * 1e3:>10.1f}{med / base:>9.3f}")
    probe = probe_memory(hf_config, hf_dir, layout)
    if args.json:
        from moe_rl.models.hf_weights import SafetensorsDir

        reader = SafetensorsDir(hf_dir)
        total = expert = 0
        for key in reader.keys():
            n = reader.get(key).numel()
            total += n
            expert += n if ".experts." in key else 0
        active = total - expert + expert * hf_config.num_experts_per_tok / hf_config.num_experts
        with open(args.json, "w") as f:
            json.dump({"variants": rows, "tokens": tokens, "active_params": active, "total_params": total,
                       "seq_len": batches[0].input_ids.shape[1], "layers": hf_config.num_hidden_layers,
                       "attn_dim": hf_config.num_attention_heads * hf_config.head_dim, "probe_memory": probe}, f, indent=2)  # fmt: skip


def probe_memory(hf_config, hf_dir: str, layout) -> list[dict]:
    """What the drift metrics keep per step, by number of micro-batches: the old pass's
    routing (expert indices on the rank's device; router distributions moved to host
    memory) is kept for the step; the update and after-update passes compare each
    micro-batch as its forward ends and keep nothing."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights
    from moe_rl.routing.monitor import RoutingMonitor

    RouterReplay.clear_global_router_replay_instances()
    model = build_model(hf_config, make_transformer_config(hf_config, layout))
    load_hf_weights(model, hf_config, hf_dir)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    print(f"\nrouting kept by the drift metrics (micro-batches of 4 x 128 tokens, {hf_config.num_hidden_layers} layers x "
          f"{hf_config.num_experts} experts)")
    print(f"{'micro-batches':>14}{'old pass, device KB':>21}{'old pass, host KB':>19}{'new passes kept KB':>20}")
    rows = []
    for n in (2, 4, 8):
        batches = [MicroBatch(torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(i))) for i in range(n)]
        monitor = RoutingMonitor(model, "none", hf_config.num_hidden_layers, hf_config.num_experts)
        with monitor.old_pass(batches) as hooks:
            run_microbatches(model, batches, hooks=hooks)
        device = nbytes([t for r in monitor._old for t in (r.natural, r.used)])
        host = nbytes([r.probs for r in monitor._old])
        with monitor.after_update_pass() as hooks:
            run_microbatches(model, batches, hooks=hooks)
            kept = lambda: nbytes([t for r in monitor.probe.captured.values() for t in (r.natural, r.used, r.probs)])  # noqa: E731
        rows.append({"micro_batches": n, "old_device_bytes": device, "old_host_bytes": host, "new_kept_bytes": kept()})
        print(f"{n:>14}{device / 1024:>21.0f}{host / 1024:>19.0f}{kept() / 1024:>20.0f}")
    return rows


if __name__ == "__main__":
    main()
