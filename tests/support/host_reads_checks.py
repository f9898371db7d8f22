"""How often a training step reads device values on the host (a sync each on a GPU), per
token dispatcher at EP = 1, counted on the stand-in accelerator (``tests/support/fake_device.py``).

A tiny Qwen3-MoE on "the GPU", its experts on the grouped-matmul path (as bf16 on Hopper),
two micro-batches forward and backward, then the optimizer step; once with moe-rl's
one-rank dispatcher, once with megatron's allgather one. Prints one JSON line: the host
reads of each pass by kind, and the number of MoE layer forwards. Run by test_layer_modules.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from fake_device import FAKE_DEVICE, HOST_READS, on_fake_device  # noqa: E402


def main() -> dict:
    from parallel import cpu_bridge

    cpu_bridge.install(FAKE_DEVICE)
    from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from moe_rl.models.architectures import model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.grouped_experts import StackedLinear
    from moe_rl.models.tiny import tiny_config
    from parallel.distributed import init_distributed
    from parallel.layout import ParallelLayout
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    hf_config = tiny_config("qwen3_moe", vocab_size=128, num_hidden_layers=2)
    out: dict = {}
    with on_fake_device():
        init_distributed(ParallelLayout(), model_dims(hf_config), seed=0)
        config = make_transformer_config(hf_config, ParallelLayout(), params_dtype=torch.float32)
        model = build_model(hf_config, config)
        for module in model.modules():
            if isinstance(module, StackedLinear):
                module.grouped = True  # the path bf16 experts take on Hopper GPUs
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        one_rank = {id(m): m.token_dispatcher for m in layers}
        settings = OptimSettings()
        ddp = wrap_ddp(model, config, settings)
        optimizer = build_optimizer([ddp], settings)
        gen = torch.Generator().manual_seed(0)
        batches = [MicroBatch(torch.randint(0, 128, (2, 16), generator=gen).to(FAKE_DEVICE)) for _ in range(2)]

        def loss_fn(le, mb):
            return -le[..., 0].sum() / 60, {}

        for name in ("one_rank", "megatron_allgather"):
            for layer in layers:
                layer.token_dispatcher = (
                    one_rank[id(layer)]
                    if name == "one_rank"
                    else MoEAllGatherTokenDispatcher(
                        layer.num_local_experts, layer.local_expert_indices, layer.config, get_default_pg_collection()
                    )
                )
            step = lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False)  # noqa: E731
            train_step([ddp], optimizer, step)  # warm: first-call work stays out of the counts
            HOST_READS.clear()
            run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False)
            forward_backward = dict(HOST_READS)
            HOST_READS.clear()
            train_step([ddp], optimizer, step)
            out[name] = {
                "dispatcher": type(layers[0].token_dispatcher).__name__,
                "forward_backward": forward_backward,
                "whole_step": dict(HOST_READS),
            }
        out["routing_stats"] = routing_stats_reads(gen)
        for layer in layers:
            layer.token_dispatcher = one_rank[id(layer)]
        out["replay_setup_and_probe"] = replay_setup_and_probe_reads(ddp, batches, hf_config, gen)
    out["moe_layer_forwards"] = len(layers) * len(batches)
    out["policy_losses"] = policy_loss_reads(gen)
    return out


def policy_loss_reads(gen: torch.Generator) -> dict:
    """Each registered policy loss, forward and backward on the trainer's ``[B]``
    advantages (inside megatron's loss step, once per micro-batch): what it reads back."""
    from moe_rl.algorithms import POLICY_LOSSES, policy_loss

    logp = (-torch.rand(3, 8, generator=gen)).to(FAKE_DEVICE).requires_grad_()
    old = (-torch.rand(3, 8, generator=gen)).to(FAKE_DEVICE)
    adv = torch.tensor([1.0, -0.5, 0.25]).to(FAKE_DEVICE)
    mask = torch.ones(3, 8).tril().to(FAKE_DEVICE)
    reads = {}
    for name in POLICY_LOSSES.names():
        HOST_READS.clear()
        loss, _ = policy_loss(name, logp, old, adv, mask, num_tokens=mask.sum(), num_seqs=3)
        loss.backward()
        reads[name] = dict(HOST_READS)
    return reads


def routing_stats_reads(gen: torch.Generator) -> dict:
    """The routing monitor's per-micro-batch accumulation (drift and load, from the update
    pass's hook), its second call on: what it reads back on the host."""
    from moe_rl.routing.stats import RoutingStats

    stats = RoutingStats(num_layers=4, num_experts=8)
    a, b = (torch.rand(6, 2, 8, generator=gen).topk(2, -1).indices.to(FAKE_DEVICE) for _ in range(2))
    mask = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool).to(FAKE_DEVICE)
    for _ in range(2):  # (the second call's reads: the first makes the layer index)
        HOST_READS.clear()
        stats.add_drift([1, 3], a, b, mask)
        stats.add_load([1, 3], a, mask)
    return dict(HOST_READS)


def replay_setup_and_probe_reads(model, batches, hf_config, gen: torch.Generator) -> dict:
    """R3's setup of engine routing for a micro-batch, and a forward pass whose router
    distributions the routing monitor keeps in host memory (for router_kl): what they read
    back on the host."""
    from moe_rl.models.forward import run_microbatches
    from moe_rl.routing.probe import RouterProbe
    from moe_rl.routing.replay import engine_routing_to_replay

    probe = RouterProbe(model)
    n_layers, k, experts = hf_config.num_hidden_layers, hf_config.num_experts_per_tok, hf_config.num_experts
    routed = [torch.randint(0, experts, (15, n_layers, k), generator=gen).to(FAKE_DEVICE) for _ in range(2)]
    HOST_READS.clear()
    engine_routing_to_replay(routed, 16, probe.layer_numbers, top_k=k, num_experts=experts)
    probe.start(probs_device=torch.device("cpu"), with_probs=True)
    with torch.no_grad():
        run_microbatches([model], batches, forward_only=True, hooks=[probe])
    kept = probe.stop()
    assert kept and all(r.probs is not None and r.probs.device.type == "cpu" for r in kept)
    return dict(HOST_READS)


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
