"""One process: the same HF weights and batch through GroupedExperts (grouped matmul and
its per-expert fallback) and megatron's SequentialMLP (run by test_grouped_experts).
Prints one JSON line: the largest log-prob and gradient differences to SequentialMLP."""

import json
import sys

import torch

from moe_rl.models.architectures import model_dims
from moe_rl.models.builder import build_model, load_hf_config, make_transformer_config
from moe_rl.models.forward import MicroBatch, run_microbatches
from moe_rl.models.grouped_experts import StackedLinear
from moe_rl.models.hf_weights import gather_hf_tensors, load_hf_weights
from parallel.distributed import init_distributed
from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings, wrap_ddp

hf_dir = sys.argv[1]
hf_config = load_hf_config(hf_dir)
layout = ParallelLayout()
init_distributed(layout, model_dims(hf_config), seed=0)
gen = torch.Generator().manual_seed(0)
batches = [MicroBatch(torch.randint(0, 64, (3, 12), generator=gen), lengths=torch.tensor([12, 9, 5])) for _ in range(2)]


def loss_fn(le, mb):
    return -(le[..., 0] * torch.linspace(0.5, 1.5, le.shape[-2])).sum() / 40, {}


def run(experts: str, grouped_matmul: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    config = make_transformer_config(hf_config, layout)
    model = build_model(hf_config, config, experts=experts)
    load_hf_weights(model, hf_config, hf_dir)
    stacked = [m for m in model.modules() if isinstance(m, StackedLinear)]
    for m in stacked:
        m.grouped = m.grouped and grouped_matmul
    ddp = wrap_ddp(model, config, OptimSettings())
    with torch.no_grad():
        logp = torch.cat([r["logprobs"] for r in run_microbatches([ddp], batches, forward_only=True)])
    ddp.zero_grad_buffer()
    run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False)
    grads = gather_hf_tensors(model, hf_config, source=lambda name, p: p.main_grad)
    return logp, grads, sum(m.grouped for m in stacked)


reference, ref_grads, _ = run("sequential")
out = {}
for name, grouped in (("grouped", True), ("fallback", False)):
    logp, grads, n_grouped = run("grouped", grouped)
    assert grads.keys() == ref_grads.keys(), sorted(grads.keys() ^ ref_grads.keys())[:4]
    out[name] = {
        "logp_max_diff": float((logp - reference).abs().max()),
        "grad_max_diff": max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads),
        "grad_max_abs": max(float(g.abs().max()) for g in ref_grads.values()),
        "grouped_matmuls": n_grouped,
    }
print(json.dumps(out))
