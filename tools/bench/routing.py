"""Per-step cost of routing replay and of the routing-drift metrics, side by side, and
what routing data costs end to end against the previous int32/int64 code.

    .venv/bin/python -m tools.bench.routing [--repeats 5] [--json FILE] [--decode-only]

One process, a small random Qwen3-MoE, one RL step = old-log-prob pass (forward) +
policy update (forward + backward, 2 micro-batches) + Adam step. Variants run
interleaved, each repeat in turn, so machine noise hits all alike; reported as median
step time and the ratio to the plain step.

Routing data at Qwen3-30B-A3B's shape (one 8k-token response, 48 layers, top-8 of 128):
rank 0's decode of SGLang's ``routed_experts`` (now vs the previous decode, interleaved)
and the bytes per token each stage keeps; then the drift metrics' kept routing on the
small model, now (router KL on / off, a quarter of the tokens) vs the previous dtypes.
Prints ``BENCH_JSON {...}`` with the routing-data figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")


QWEN3_30B = dict(tokens=8192, layers=48, top_k=8, experts=128)  # one long response of Qwen3-30B-A3B


def _previous_decode(encoded: str, positions: int, num_layers: int, top_k: int, num_experts: int):
    """The SGLang client's decode before this change (int32, validated with a sort), for comparison."""
    import base64

    import numpy as np

    raw = base64.b64decode(encoded)
    experts = torch.from_numpy(np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k).astype(np.int32))
    if experts.shape[0] != positions:
        raise ValueError("positions")
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError("range")
    ordered = experts.sort(dim=-1).values
    if top_k > 1 and (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError("repeats")
    return experts


def routing_data(repeats: int) -> dict:
    """Rank 0's decode of one response's ``routed_experts`` (median ms, now vs before,
    interleaved) and the bytes per token kept at each stage, measured on real tensors of
    Qwen3-30B-A3B's shape."""
    import base64

    from moe_rl.rollout.sglang.engine import SGLangEngine
    from moe_rl.routing.replay import engine_routing_to_replay

    t, l, k, e = (QWEN3_30B[x] for x in ("tokens", "layers", "top_k", "experts"))
    gen = torch.Generator().manual_seed(0)
    # distinct experts per token and layer
    routed = torch.rand(t * l, e, generator=gen).argsort(-1)[:, :k].view(t, l, k)
    encoded = base64.b64encode(routed.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")
    reply = json.dumps({"meta_info": {"routed_experts": encoded}}).encode()
    engine = SGLangEngine(["http://127.0.0.1:1"], num_layers=l, top_k=k, num_experts=e)
    decoders = {
        "now": lambda: engine._decode_routing(encoded, t),
        "before": lambda: _previous_decode(encoded, t, l, k, e),
        "json.loads of the reply (unchanged, for scale)": lambda: json.loads(reply),
    }
    times = {name: [] for name in decoders}
    for _ in range(repeats):
        for name, decode in decoders.items():
            start = time.perf_counter()
            decode()
            times[name].append(time.perf_counter() - start)
    now, before = engine._decode_routing(encoded, t), _previous_decode(encoded, t, l, k, e)
    assert torch.equal(now.to(torch.int32), before)
    per_token = lambda x: x.numel() * x.element_size() / t  # noqa: E731
    replay_now = engine_routing_to_replay([now], t + 1, list(range(l)), k, num_experts=e)  # R3's kept replay indices
    replay_before = [x.to(torch.int64) for x in replay_now]  # before: the whole micro-batch in int64
    out = {
        "shape": QWEN3_30B,
        "base64_mb": len(encoded) / 1e6,
        "decode_ms": {n: statistics.median(v) * 1e3 for n, v in times.items()},
        "bytes_per_token": {
            "sample: rank 0, and each rank's share (host)": (per_token(now), per_token(before)),
            "R3 replay indices, kept for the step (device)": (
                sum(map(per_token, replay_now)),
                sum(map(per_token, replay_before)),
            ),
            "drift: old pass top-k, natural + used (device) *": (2 * per_token(now), 2 * per_token(now) * 8),
            "drift: old pass router distributions (host) *": (0, 4 * l * e),
            "  ... with routing.after_update_pass (router_kl) *": (4 * l * e, 4 * l * e),
        },
    }
    print(
        f"\nrouting data of one {t}-token response, {l} layers x top-{k} of {e} experts (Qwen3-30B-A3B), "
        f"{out['base64_mb']:.1f} MB of base64; median of {repeats}"
    )
    print(f"{'rank-0 decode + checks (shape, range, repeats)':<70}{'now':>10}{'before':>10}")
    print(f"{'  ms':<70}{out['decode_ms']['now']:>10.1f}{out['decode_ms']['before']:>10.1f}")
    print(
        f"{'  json.loads of the reply (unchanged, for scale), ms':<70}{out['decode_ms']['json.loads of the reply (unchanged, for scale)']:>10.1f}"
    )
    print(f"{'bytes per token kept':<70}{'now':>10}{'before':>10}")
    for name, (a, b) in out["bytes_per_token"].items():
        print(f"{name:<70}{a:>10.0f}{b:>10.0f}")
    print(
        "* element sizes x this shape (now: only with the after-update pass; the small model's figures are measured below)"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument(
        "--decode-only", action="store_true", help="only the routing-data figures at Qwen3-30B-A3B's shape"
    )
    args = parser.parse_args()
    data = routing_data(max(args.repeats, 5))
    if args.decode_only:
        print("BENCH_JSON " + json.dumps({"routing_data": data}))
        return

    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl.models.architectures import load_hf_config, model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights
    from moe_rl.models.tiny import save_tiny_checkpoint
    from moe_rl.routing.hf_routing import transformers_routing
    from moe_rl.routing.monitor import RoutingMonitor
    from moe_rl.routing.step_replay import StepReplay
    from moe_rl.trainer.old_policy import StepRouting
    from moe_rl.routing.replay import replay_config_overrides
    from parallel.distributed import init_distributed
    from parallel.layout import ParallelLayout
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    size = dict(
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        vocab_size=512,
    )
    hf_dir = save_tiny_checkpoint(tempfile.mkdtemp() + "/hf", "qwen3_moe", seed=0, **size)
    hf_config = load_hf_config(hf_dir)
    layout = ParallelLayout()
    init_distributed(layout, model_dims(hf_config))
    gen = torch.Generator().manual_seed(0)
    batches = [MicroBatch(torch.randint(0, 512, (4, 128), generator=gen)) for _ in range(2)]
    tokens = sum(mb.input_ids.numel() for mb in batches)
    from transformers import AutoModelForCausalLM

    engine = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for mb in batches:  # the engine's routed experts travel with each micro-batch, as the trainer's do
        mb.routed_experts = [r[:-1] for r in transformers_routing(engine, mb.input_ids)[0]]

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
        passes = StepRouting(
            model,
            hf_config.num_experts,
            StepReplay(model, mode) if mode != "none" else None,
            RoutingMonitor(model, hf_config.num_hidden_layers, hf_config.num_experts) if drift else None,
        )
        with_engine = mode == "r3" or drift

        def step(ddp=ddp, optimizer=optimizer, passes=passes, drift=drift, after=after, with_engine=with_engine):
            with passes.old_pass(batches, engine_routing=with_engine) as hooks:
                run_microbatches([ddp], batches, hooks=hooks)
            with passes.update_pass() as hooks:
                train_step(
                    [ddp],
                    optimizer,
                    lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False, hooks=hooks),
                )
            if after:
                with passes.after_update_pass() as hooks:
                    run_microbatches([ddp], batches, hooks=hooks)
            if drift:
                passes.monitor.reduce()

        step()  # warm-up
        steps[name] = step
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print(
        f"RL step (old-log-prob pass + update + Adam), {tokens} tokens, {hf_config.num_hidden_layers} MoE layers x "
        f"{hf_config.num_experts} experts (top-{hf_config.num_experts_per_tok}), 1 CPU process, median of {args.repeats}"
    )
    print(f"{'variant':<28}{'ms/step':>10}{'x plain':>9}")
    rows = {}
    for name in variants:
        med = statistics.median(times[name])
        rows[name] = {"ms": med * 1e3, "ratio": med / base}
        print(f"{name:<28}{med * 1e3:>10.1f}{med / base:>9.3f}")
    probe = probe_memory(hf_config, hf_dir, layout)
    print("BENCH_JSON " + json.dumps({"routing_data": data, "probe_memory": probe, "variants": rows}))
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
            json.dump(
                {
                    "variants": rows,
                    "tokens": tokens,
                    "active_params": active,
                    "total_params": total,
                    "seq_len": batches[0].input_ids.shape[1],
                    "layers": hf_config.num_hidden_layers,
                    "attn_dim": hf_config.num_attention_heads * hf_config.head_dim,
                    "probe_memory": probe,
                    "routing_data": data,
                },
                f,
                indent=2,
            )


def probe_memory(hf_config, hf_dir: str, layout) -> list[dict]:
    """What the drift metrics keep per step, by number of micro-batches: the old pass's
    routing (expert indices on the rank's device; router distributions moved to host
    memory, only for router KL) is kept for the step; the update and after-update passes
    compare each micro-batch as its forward ends and keep nothing. Measured now with the
    defaults, without router KL (``routing.after_update_pass=false``) and on a quarter of
    the tokens (``routing.metrics_sample_frac=0.25``); "before" is the defaults' tensors at
    the previous code's types (int64 indices, router distributions always kept)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights
    from moe_rl.routing.monitor import RoutingMonitor

    RouterReplay.clear_global_router_replay_instances()
    model = build_model(hf_config, make_transformer_config(hf_config, layout))
    load_hf_weights(model, hf_config, hf_dir)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731

    def old_pass(batches, **options) -> tuple[int, int, int]:
        """(device bytes, host bytes, bytes at the previous types) the old pass keeps."""
        monitor = RoutingMonitor(model, hf_config.num_hidden_layers, hf_config.num_experts, **options)
        with monitor.old_pass(batches) as hooks:
            run_microbatches(model, batches, hooks=hooks)
        indices = [t for r in monitor._old for t in (r.natural, r.used)]
        host = nbytes([r.probs for r in monitor._old])
        with monitor.after_update_pass() as hooks:  # keeps nothing past each micro-batch
            run_microbatches(model, batches, hooks=hooks)
            assert not monitor.probe.captured
        return nbytes(indices), host, sum(t.numel() * 8 for t in indices) + host

    print(
        f"\nrouting kept by the drift metrics per step (micro-batches of 4 x 128 tokens, {hf_config.num_hidden_layers} layers x "
        f"{hf_config.num_experts} experts), KB: now (defaults) vs before; now without router KL; now on a quarter of the tokens"
    )
    print(f"{'micro-batches':>14}{'device':>9}{'host':>9}{'before':>9}{'no KL':>9}{'quarter':>9}")
    rows = []
    for n in (2, 4, 8):
        batches = [
            MicroBatch(torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(i))) for i in range(n)
        ]
        device, host, before = old_pass(batches)
        no_kl = sum(old_pass(batches, router_kl=False)[:2])
        quarter = sum(old_pass(batches, sample_frac=0.25)[:2])
        rows.append(
            {
                "micro_batches": n,
                "old_device_bytes": device,
                "old_host_bytes": host,
                "new_kept_bytes": 0,
                "before_bytes": before,
                "no_router_kl_bytes": no_kl,
                "quarter_tokens_bytes": quarter,
            }
        )
        print(
            f"{n:>14}{device / 1024:>9.0f}{host / 1024:>9.0f}{before / 1024:>9.0f}{no_kl / 1024:>9.0f}{quarter / 1024:>9.0f}"
        )
    return rows


if __name__ == "__main__":
    main()
