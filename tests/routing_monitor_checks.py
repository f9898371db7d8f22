"""One-process training steps through RoutingMonitor (run by test_routing_monitor).

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
from moe_rl.routing.replay import replay_config_overrides
from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

from one_process import random_micro_batches, start_one_process

hf_dir = sys.argv[1]
hf_config, layout = start_one_process(hf_dir)
gen = torch.Generator().manual_seed(0)
batches = random_micro_batches([10, 7], gen)
engine = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
engine_routing = []
for mb in batches:
    idx, _ = transformers_routing(engine, mb.input_ids)
    engine_routing.append([idx[j, : int(mb.lengths[j]) - 1] for j in range(2)])


def loss_fn(le, mb):
    return -le[..., 0].sum() / 40, {}


for mode in ("none", "r2", "r3"):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    config = make_transformer_config(hf_config, layout, **replay_config_overrides(mode))
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, hf_dir)
    settings = OptimSettings(lr=0.05)
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    monitor = RoutingMonitor(model, mode, hf_config.num_hidden_layers, hf_config.num_experts)
    try:  # a pass that fails leaves the monitor idle, ready for the next step
        with monitor.old_pass(batches, engine_routing) as hooks:
            raise RuntimeError("a failed forward")
    except RuntimeError:
        pass
    with monitor.old_pass(batches, engine_routing) as hooks:
        run_microbatches([ddp], batches, hooks=hooks)
    with monitor.update_pass() as hooks:
        train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False, hooks=hooks))
    with monitor.after_update_pass() as hooks:
        run_microbatches([ddp], batches, hooks=hooks)
    metrics = monitor.reduce()
    print(json.dumps({"mode": mode, **{g: {k: v.tolist() for k, v in m.items()} for g, m in metrics.items()}}), flush=True)
