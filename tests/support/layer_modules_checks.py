"""One process: the same HF weights and batch through every choice of experts module
(GroupedExperts with the grouped matmul and with its per-expert fallback, megatron's
SequentialMLP), core attention (SdpaAttention, megatron's DotProductAttention) and token
dispatcher (the one-rank dispatcher given at EP = 1, megatron's allgather and alltoall); and
SdpaAttention against DotProductAttention on random inputs under each mask it may get;
what the Transformer Engine spec changes in each family's layer spec (its classes are
placeholders without TE: only the spec is built). Run by test_layer_modules; prints one
JSON line."""

import json
import sys
from unittest import mock

import torch

from moe_rl.models import builder
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


def run(modules: LayerModules, grouped_matmul: bool = True, megatron_dispatcher: bool = False, **overrides) -> dict:
    config = make_transformer_config(hf_config, layout, **overrides)
    if megatron_dispatcher:  # the model as built before the one-rank dispatcher was given to it
        with mock.patch.object(builder, "use_one_rank_dispatchers", lambda model: 0):
            model = build_model(hf_config, config, modules=modules)
    else:
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
    return {
        "logp": logp,
        "grads": grads,
        "grouped_matmuls": sum(m.grouped for m in stacked),
        "sdpa_modules": sdpa,
        "dispatchers": sorted(dispatchers),
    }


def attention_checks(config) -> dict:
    """SdpaAttention vs megatron's local attention (GQA: 4 query heads, 2 groups), forward
    and input gradients, with the shared causal mask, an equal copy of it, and a padding mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    sdpa, local = SdpaAttention(**args), DotProductAttention(**args)
    s, b, d = 7, 2, config.kv_channels
    inputs = [
        torch.randn(s, b, n, d, generator=gen)
        for n in (config.num_attention_heads, config.num_query_groups, config.num_query_groups)
    ]
    padding = causal_mask(s, torch.device("cpu")) | (torch.arange(s) >= 5)  # keys past 5 masked too
    out = {}
    for name, mask in (
        ("shared_causal", causal_mask(s, torch.device("cpu"))),
        ("copied_causal", causal_mask(s, torch.device("cpu")).clone()),
        ("padding", padding),
    ):
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
    "grouped_sdpa_megatron_allgather": (LayerModules(), True, {"megatron_dispatcher": True}),
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
for other in ("grouped_sdpa_alltoall", "grouped_sdpa_megatron_allgather"):
    a, b = runs[other], runs["grouped_sdpa"]
    out[f"{other}_vs_one_rank"] = {
        "logp_max_diff": float((a["logp"] - b["logp"]).abs().max()),
        "grad_max_diff": max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in a["grads"]),
    }
out["grad_max_abs"] = max(float(g.abs().max()) for g in reference["grads"].values())
out["attention"] = attention_checks(make_transformer_config(hf_config, layout))


def spec_classes(spec, path: str = "") -> dict[str, str]:
    """Every module class a layer spec names, by its path in the spec (TE's by role)."""
    import dataclasses

    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.transformer.spec_utils import ModuleSpec

    te = TESpecProvider()
    roles = {
        id(te.column_parallel_linear()): "TE column-parallel linear",
        id(te.row_parallel_linear()): "TE row-parallel linear",
        id(te.core_attention()): "TE attention",
    }
    out = {}
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        module = value.module if isinstance(value, ModuleSpec) else value
        out[path + field.name] = roles.get(id(module), getattr(module, "__name__", str(module)))
        if isinstance(value, ModuleSpec) and dataclasses.is_dataclass(value.submodules):
            out.update(spec_classes(value.submodules, f"{path}{field.name}."))
    return out


def transformer_engine_spec_changes() -> dict:
    """Per family and experts module: {path: [local class, TE spec class]} where they differ."""
    import megatron.core.extensions.transformer_engine as te_extension

    from moe_rl.models.architectures import architecture_of
    from moe_rl.models.layers import decoder_block_spec
    from moe_rl.models.tiny import tiny_config

    te_extension.HAVE_TE = True  # the spec only: nothing is built from it here
    changes = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        family_config = tiny_config(family)
        config = make_transformer_config(family_config, layout)
        qk_norm = architecture_of(family_config).qk_norm(family_config)
        for experts in ("grouped", "sequential"):
            specs = [
                decoder_block_spec(config, qk_norm, LayerModules(experts=experts, transformer_impl=impl))
                for impl in ("local", "transformer_engine")
            ]
            for layer, (local, te) in enumerate(zip(*(s.layer_specs for s in specs))):
                a, b = spec_classes(local.submodules), spec_classes(te.submodules)
                changes[f"{family}/{experts}/{layer}"] = {k: [a[k], b[k]] for k in a if a[k] != b[k]}
                assert a.keys() == b.keys()
            assert spec_classes(specs[0])["layer_norm"] == spec_classes(specs[1])["layer_norm"] == "RMSNorm"
    te_extension.HAVE_TE = False
    return changes


out["transformer_engine_spec"] = transformer_engine_spec_changes()


def dispatchers_under_permute_fusion() -> list[str]:
    """The dispatchers built with TE's fused permutation on (TE's functions stand-ins: only
    the build runs): megatron's, whose combine hands TE the row map TE's permute made."""
    from megatron.core.transformer.moe import moe_utils

    fused = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index")
    fused += ("fused_sort_chunks_by_index_with_probs", "fused_unpermute")
    with mock.patch.multiple(moe_utils, **{name: lambda *a, **k: None for name in fused}, create=True):
        model = build_model(hf_config, make_transformer_config(hf_config, layout, moe_permute_fusion=True))
    return sorted({type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")})


def output_weight_grads_under_ddp() -> dict:
    """A bf16 output weight wrapped in megatron DDP, its log-probs taken one position per
    chunk over two micro-batches: its fp32 ``main_grad`` against fp64, and the error of
    the bf16 sum autograd would give; with the weight also looked up as the input
    embedding (megatron's tied case, ``zero_out_wgrad``), the embedding's share kept."""
    from moe_rl.models.logprob_head import LogProbConfig, vocab_parallel_logprobs

    gen = torch.Generator().manual_seed(5)
    s, b, h, v = 48, 2, 16, 40
    weight = (torch.randn(v, h, generator=gen) / 4).to(torch.bfloat16)
    ids, targets = torch.randint(0, v, (2, s, b), generator=gen), torch.randint(0, v, (2, s, b), generator=gen)
    free_hidden = torch.randn(2, s, b, h, generator=gen).to(torch.bfloat16)
    probe = torch.randn(2, s, b, generator=gen)

    class Head(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.weight, self.tied = torch.nn.Parameter(weight.clone()), tied

        def forward(self, mb: int) -> torch.Tensor:
            hidden = torch.nn.functional.embedding(ids[mb], self.weight) if self.tied else free_hidden[mb]
            cfg = LogProbConfig(chunk_size=1, keep_logits_mb=0.0)
            return (vocab_parallel_logprobs(hidden, self.weight, targets[mb], config=cfg)[0] * probe[mb]).sum()

    def reference(tied: bool, through_embedding: bool = True) -> torch.Tensor:
        w = weight.double().requires_grad_(True)
        for mb in range(2):
            table = w if through_embedding else w.detach()
            hidden = torch.nn.functional.embedding(ids[mb], table) if tied else free_hidden[mb].double()
            logp = torch.log_softmax(hidden @ w.t(), -1).gather(-1, targets[mb].unsqueeze(-1)).squeeze(-1)
            (logp * probe[mb]).sum().backward()
        return w.grad

    def bf16_chunk_sum() -> torch.Tensor:
        """What autograd summed before: each chunk's gradient rounded to bf16 and added in
        bf16 within a micro-batch; DDP's hook adding each micro-batch's into fp32."""
        main_grad = torch.zeros(v, h)
        for mb in range(2):
            acc = torch.zeros(v, h, dtype=torch.bfloat16)
            for t in range(s):
                hid = free_hidden[mb, t].float()  # [b, h]
                d_logits = probe[mb, t, :, None] * (
                    torch.nn.functional.one_hot(targets[mb, t], v) - torch.softmax(hid @ weight.float().t(), -1)
                )
                acc += (d_logits.t() @ hid).to(torch.bfloat16)
            main_grad += acc.float()
        return main_grad

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
        return float((a.double() - ref).norm() / ref.norm())

    out = {}
    for tied in (False, True):
        head = Head(tied)
        if tied:
            head.weight.zero_out_wgrad = True  # as megatron's LanguageModule marks a tied weight
        ddp = wrap_ddp(head, make_transformer_config(hf_config, layout), OptimSettings())
        ddp.zero_grad_buffer()
        torch.use_deterministic_algorithms(True)  # which fills torch.empty with NaN: a dummy gradient must not count
        for mb in range(2):
            ddp(mb).backward()
        torch.use_deterministic_algorithms(False)
        ddp.finish_grad_sync()
        key = "tied" if tied else "untied"
        out[f"{key}_main_grad_rel_err"] = rel(head.weight.main_grad, reference(tied))
        out[f"{key}_grad_left"] = head.weight.grad is not None
    out["tied_rel_err_if_embedding_share_lost"] = rel(head.weight.main_grad, reference(True, through_embedding=False))
    out["untied_bf16_sum_rel_err"] = rel(bf16_chunk_sum(), reference(False))
    return out


out["dispatchers_under_permute_fusion"] = dispatchers_under_permute_fusion()
out["output_weight_grads"] = output_weight_grads_under_ddp()
print(json.dumps(out))
