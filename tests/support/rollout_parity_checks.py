"""LocalEngine vs the megatron trainer on the same weights (run by test_rollout_local).

Prints one JSON line: max |logp_engine - logp_trainer| over response tokens, and whether
the engine's routed experts equal the trainer's own top-k on every routed position."""

import json
import sys

import torch

from moe_rl.models.architectures import load_hf_config, model_dims
from moe_rl.models.builder import build_model, make_transformer_config
from moe_rl.models.forward import MicroBatch, run_microbatches
from moe_rl.models.hf_weights import load_hf_weights
from moe_rl.rollout.local import LocalEngine
from moe_rl.rollout.types import SamplingParams
from moe_rl.routing.probe import RouterProbe
from parallel.distributed import init_distributed
from parallel.layout import ParallelLayout

hf_dir, temperature = sys.argv[1], float(sys.argv[2])
engine = LocalEngine(hf_dir)
prompts = [[3, 17, 22, 5], [9, 1, 40, 33, 2, 8]]
groups = engine.generate(
    prompts, 3, SamplingParams(max_new_tokens=12, temperature=temperature), seed=7, return_routed_experts=True
)

hf_config = load_hf_config(hf_dir)
layout = ParallelLayout()
init_distributed(layout, model_dims(hf_config))
model = build_model(hf_config, make_transformer_config(hf_config, layout))
load_hf_weights(model, hf_config, hf_dir)
model.logprob_config.temperature = temperature
probe = RouterProbe(model)
max_diff, routing_equal, positions = 0.0, True, 0
for group in groups:
    for s in group:
        ids = torch.tensor([s.prompt_ids + s.output_ids])
        probe.start()
        (res,) = run_microbatches(model, [MicroBatch(ids)], hooks=[probe])
        (probed,) = probe.stop()
        trainer = res["logprobs"][0, len(s.prompt_ids) - 1 :]
        max_diff = max(max_diff, (trainer - torch.tensor(s.output_logprobs)).abs().max().item())
        n = s.routed_experts.shape[0]
        ours = probed.natural[:n].sort(-1).values  # [T, L, k] (all layers are MoE here)
        theirs = s.routed_experts.long().sort(-1).values
        routing_equal &= torch.equal(ours, theirs)
        positions += n
print(
    json.dumps(
        {
            "max_diff": max_diff,
            "routing_equal": routing_equal,
            "positions": positions,
            "lengths": [len(s.output_ids) for g in groups for s in g],
        }
    )
)
