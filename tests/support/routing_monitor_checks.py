"""One-process training steps through a step's routing passes: StepReplay and RoutingMonitor
(run by test_routing_monitor).

Prints one JSON line of results per replay mode."""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from moe_rl.models.builder import build_model, make_transformer_config
from moe_rl.models.forward import run_microbatches
from moe_rl.models.hf_weights import load_hf_weights
from moe_rl.routing.hf_routing import transformers_routing
from moe_rl.routing.monitor import RoutingMonitor
from moe_rl.routing.step_replay import StepReplay
from moe_rl.trainer.old_policy import StepRouting
from moe_rl.routing.replay import RoutingReplay, engine_routing_to_replay, moe_layers, replay_config_overrides
from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

from one_process import random_micro_batches, start_one_process

hf_dir = sys.argv[1]
hf_config, layout = start_one_process(hf_dir)
gen = torch.Generator().manual_seed(0)
batches = random_micro_batches([10, 7], gen)
engine = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
for mb in batches:  # the "engine"'s routed experts travel with each micro-batch, as the trainer's do
    idx, _ = transformers_routing(engine, mb.input_ids)
    mb.routed_experts = [idx[j, : int(mb.lengths[j]) - 1] for j in range(2)]
engine_routing = [mb.routed_experts for mb in batches]


def loss_fn(le, mb):
    return -le[..., 0].sum() / 40, {}


from megatron.core.transformer.moe.router_replay import RouterReplay


def fresh_model(mode: str):
    RouterReplay.clear_global_router_replay_instances()
    config = make_transformer_config(hf_config, layout, **replay_config_overrides(mode))
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, hf_dir)
    return model, config


# run "r3_sampled": r3 with the metrics on a third of the tokens and no router KL
for mode, sample_frac in (("none", 1.0), ("r2", 1.0), ("r3", 1.0), ("r3_sampled", 1 / 3)):
    model, config = fresh_model(mode.split("_")[0])
    settings = OptimSettings(lr=0.05)
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    monitor = RoutingMonitor(
        model,
        hf_config.num_hidden_layers,
        hf_config.num_experts,
        sample_frac=sample_frac,
        router_kl=sample_frac == 1,
    )
    replay_mode = mode.split("_")[0]
    replay = StepReplay(model, replay_mode) if replay_mode != "none" else None
    routing = StepRouting(model, hf_config.num_experts, replay, monitor)
    try:  # a pass that fails leaves the monitor and the replay idle, ready for the next step
        with routing.old_pass(batches, engine_routing=True) as hooks:
            raise RuntimeError("a failed forward")
    except RuntimeError:
        pass
    with routing.old_pass(batches, engine_routing=True) as hooks:
        run_microbatches([ddp], batches, hooks=hooks)
    kept = {
        "observed_tokens": [len(r.used) for r in monitor._old],
        "index_dtypes": sorted({str(r.used.dtype) for r in monitor._old}),
        "old_probs_kept": [r.probs is not None for r in monitor._old],
        "replay_dtypes": sorted({str(t.dtype) for mb in (replay.indices if replay else []) for t in mb}),
    }
    with routing.update_pass() as hooks:
        train_step(
            [ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False, hooks=hooks)
        )
    with routing.after_update_pass() as hooks:
        run_microbatches([ddp], batches, hooks=hooks)
    metrics = monitor.reduce()
    print(
        json.dumps(
            {"mode": mode, "kept": kept, **{g: {k: v.tolist() for k, v in m.items()} for g, m in metrics.items()}}
        ),
        flush=True,
    )

# R3 replay from the compact indices the trainer keeps equals replay from int64 (megatron's own type)
model, _ = fresh_model("r3")
replay, layers = RoutingReplay(model), [router for _, router in moe_layers(model)]
compact = [
    engine_routing_to_replay(
        [r.to(torch.uint8) for r in routed],
        mb.input_ids.shape[1],
        replay.layer_numbers,
        replay.top_k,
        num_experts=hf_config.num_experts,
    )
    for mb, routed in zip(batches, engine_routing)
]


def reported_loss(le, mb):
    loss, _ = loss_fn(le, mb)
    return loss, {"loss": loss.detach()}


def replayed_step(indices):
    model.zero_grad()
    replay.start_replay(indices)
    out = run_microbatches(model, batches, loss_fn=reported_loss, forward_only=False, hooks=[replay])
    replay.finish()
    return [o["logprobs"] for o in out], [o["loss"] for o in out], [r.weight.grad.clone() for r in layers]


(logp_c, loss_c, grad_c), (logp_w, loss_w, grad_w) = (
    replayed_step(compact),
    replayed_step([[t.long() for t in mb] for mb in compact]),
)
own = run_microbatches(model, batches)  # no replay: the model's own routing, which transformers' (the "engine") equals
print(
    json.dumps(
        {
            "mode": "compact_vs_int64",
            "compact_dtype": str(compact[0][0].dtype),
            "max_diff_to_own_routing": max(
                float((a - o["logprobs"])[j, : int(n) - 1].abs().max())  # where the engine routed
                for a, o, mb in zip(logp_c, own, batches)
                for j, n in enumerate(mb.lengths)
            ),
            "logprobs_equal": all(torch.equal(a, b) for a, b in zip(logp_c, logp_w)),
            "losses_equal": all(torch.equal(a, b) for a, b in zip(loss_c, loss_w)),
            "router_grads_equal": all(torch.equal(a, b) for a, b in zip(grad_c, grad_w)),
            "router_grad_min": min(float(g.norm()) for g in grad_c),
        }
    ),
    flush=True,
)

# a sample without engine routing (an empty response: SGLang returns none) among routed ones:
# its positions hold replay filler, which the train-vs-rollout drift must leave out
model, _ = fresh_model("none")
monitor = RoutingMonitor(model, hf_config.num_hidden_layers, hf_config.num_experts, router_kl=False)
routing = StepRouting(model, hf_config.num_experts, None, monitor)
saved = batches[0].routed_experts
batches[0].routed_experts = [saved[0], None]
with routing.old_pass(batches, engine_routing=True) as hooks:
    run_microbatches(model, batches, hooks=hooks)
batches[0].routed_experts = saved
metrics = monitor.reduce()
print(json.dumps({"mode": "empty_response", **{k: v.tolist() for k, v in metrics["train_vs_rollout"].items()}}))
