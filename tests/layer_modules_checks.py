"""One process: the same HF weights and batch through every choice of experts module
(GroupedExperts with the grouped matmul and with its per-expert fallback, megatron's
SequentialMLP), core attention (SdpaAttention, megatron's DotProductAttention) and token
dispatcher (the allgather one chosen at EP = 1, megatron's alltoall); and
SdpaAttention against DotProductAttention on random inputs under each mask it may get.
Run by test_layer_modules; prints one JSON line."""

import json
import sys

import torch

from moe_rl.models.builder import build_model, make_transformer_config
from moe_rl.models.forward import run_microbatches
from moe_rl.models.grouped_experts import StackedLinear
from moe_rl.models.hf_weights import gather_hf_tensors, load_hf_weights
from moe_rl.models.layers import LayerModules, SdpaAttention, causal_mask
from parallel.optim import OptimSettings, wrap_ddp

from one_process import random_micro_batches, start_one_process

hf_dir = sys.argv[1]
hf_config, layout = start_one_process(hf_dir)
gen = torch.Generator().manual_seed(0)
batches = random_micro_batches([12, 9, 5], gen)


def loss_fn(le, mb):
    return -(le[..., 0] * torch.linspace(0.5, 1.5, le.shape[-2])).sum() / 40, {}


def run(modules: LayerModules, grouped_matmul: bool = True, **overrides) -> dict:
    config = make_transformer_config(hf_config, layout, **overrides)
    model = build_model(hf_config, config, modules=modules)
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
    sdpa = sum(isinstance(m, SdpaAttention) for m in model.modules())
    dispatchers = {type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")}
    return {"logp": logp, "grads": grads, "grouped_matmuls": sum(m.grouped for m in stacked), "sdpa_modules": sdpa,
            "dispatchers": sorted(dispatchers)}  # fmt: skip


def attention_checks(config) -> dict:
    """SdpaAttention vs megatron's local attention (GQA: 4 query heads, 2 groups), forward
    and input gradients, with the shared causal mask, an equal copy of it, and a padding mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    sdpa, local = SdpaAttention(**args), DotProductAttention(**args)
    s, b, d = 7, 2, config.kv_channels
    inputs = [torch.randn(s, b, n, d, generator=gen) for n in (config.num_attention_heads, config.num_query_groups, config.num_query_groups)]
    padding = causal_mask(s, torch.device("cpu")) | (torch.arange(s) >= 5)  # keys past 5 masked too
    out = {}
    for name, mask in (("shared_causal", causal_mask(s, torch.device("cpu"))), ("copied_causal", causal_mask(s, torch.device("cpu")).clone()),
                       ("padding", padding)):  # fmt: skip
        results = []
        for module in (sdpa, local):
            leaves = [t.clone().requires_grad_() for t in inputs]
            context = module(*leaves, mask)
            (context * torch.linspace(-1, 1, context.numel()).view_as(context)).sum().backward()
            results.append([context.detach(), *(t.grad for t in leaves)])
        out[name] = max(float((x - y).abs().max()) for x, y in zip(*results))
    return out


reference = run(LayerModules(experts="sequential", attention="local"))
out = {}
variants = {
    "grouped_sdpa": (LayerModules(), True, {}),
    "fallback_sdpa": (LayerModules(), False, {}),
    "grouped_local": (LayerModules(attention="local"), True, {}),
    "sequential_sdpa": (LayerModules(experts="sequential"), True, {}),
    "grouped_sdpa_alltoall": (LayerModules(), True, {"moe_token_dispatcher_type": "alltoall"}),
}
runs = {}
for name, (modules, grouped, overrides) in variants.items():
    r = runs[name] = run(modules, grouped, **overrides)
    assert r["grads"].keys() == reference["grads"].keys(), sorted(r["grads"].keys() ^ reference["grads"].keys())[:4]
    out[name] = {
        "logp_max_diff": float((r["logp"] - reference["logp"]).abs().max()),
        "grad_max_diff": max(float((r["grads"][k] - reference["grads"][k]).abs().max()) for k in r["grads"]),
        "grouped_matmuls": r["grouped_matmuls"],
        "sdpa_modules": r["sdpa_modules"],
        "dispatchers": r["dispatchers"],
    }
a, b = runs["grouped_sdpa_alltoall"], runs["grouped_sdpa"]
out["alltoall_vs_allgather"] = {
    "logp_max_diff": float((a["logp"] - b["logp"]).abs().max()),
    "grad_max_diff": max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in a["grads"]),
}
out["grad_max_abs"] = max(float(g.abs().max()) for g in reference["grads"].values())
out["attention"] = attention_checks(make_transformer_config(hf_config, layout))
print(json.dumps(out))
