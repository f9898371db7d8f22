"""``tools/gpu_check/check.py``'s numerical stages: kernels (grouped_mm against the per-expert loop,
attention under activation recompute), the log-prob head, bf16 parity against transformers and
the fusions (Transformer Engine, fused Adam). Each ``stage_<name>(mode, checks, work)`` records
its assertions in ``checks`` and returns its figures."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tools.gpu_check.common import Checks, cuda, device, one_rank, peak_mb, rel_err, sync, timed

FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BF16_REL = 1e-2  # bf16 outputs against an fp32 reference: one rounding is 2**-8 = 3.9e-3 of the value
BF16_GRAD_REL = 2e-2  # gradients: two bf16 products in a row


# ----------------------------------------------------------------------- kernels


def ragged_counts(mode: str) -> list[int]:
    """Rows per expert as routing makes them: uneven, with empty experts (first, middle, last)."""
    if mode == "smoke":
        return [0, 3, 17, 0, 1, 9, 0]
    return [0, 1, 7, 513, 0, 2048, 31, 4096, 0, 128, 3, 900, 0, 64, 1200, 0]


def stage_kernels(mode: str, checks: Checks, work: Path) -> dict:
    return {"grouped_mm": grouped_mm_check(mode, checks), "attention": recomputed_attention_check(mode, checks, work)}


def grouped_mm_check(mode: str, checks: Checks) -> dict:
    """``StackedLinear`` with torch's grouped matmul against its per-expert loop and an fp32
    loop, on ragged and empty groups, forward and backward; and with no rows at all."""
    import torch
    import torch.nn.functional as F

    from moe_rl.models.grouped_experts import StackedLinear

    dev, dtype = device(), torch.bfloat16
    counts = ragged_counts(mode)
    hidden, out_features = (64, 96) if mode == "smoke" else (2048, 1536)
    config = SimpleNamespace(use_cpu_initialization=dev.type == "cpu", params_dtype=dtype)
    layer = StackedLinear(len(counts), out_features, hidden, config, partition_dim=1)
    torch.nn.init.normal_(layer.weight, std=hidden**-0.5)
    figures = {"counts": counts, "hidden": hidden, "out": out_features, "chosen_by_default": layer.grouped}
    if not hasattr(F, "grouped_mm"):  # (the experts then take their per-expert loop)
        checks.skip("grouped_mm", f"torch {torch.__version__} has no torch.nn.functional.grouped_mm")
        return figures
    if dev.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0):
        checks.check("StackedLinear picks grouped_mm by itself (bf16, SM90+)", layer.grouped, "==", True)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(sum(counts), hidden, generator=gen).to(dev, dtype)
    upstream = torch.randn(sum(counts), out_features, generator=gen).to(dev)
    offsets = torch.tensor(counts).cumsum(0).to(device=dev, dtype=torch.int32)
    want = _fp32_loop(layer.weight.detach(), rows, counts, upstream)
    got = {grouped: _run_stacked(layer, rows, offsets, counts, upstream, grouped) for grouped in (True, False)}
    for what, i, limit in (
        ("forward", 0, BF16_REL),
        ("rows grad", 1, BF16_GRAD_REL),
        ("weight grad", 2, BF16_GRAD_REL),
    ):
        figures[f"{what} rel err loop"] = rel_err(got[False][i], want[i])
        checks.check(
            f"grouped_mm {what} vs fp32 loop (ragged + empty groups)", rel_err(got[True][i], want[i]), "<=", limit
        )
    empty = [e for e, n in enumerate(counts) if n == 0]
    checks.check("grouped_mm weight grad of empty experts", float(got[True][2][empty].abs().max()), "==", 0.0)
    _no_rows_check(layer, offsets, checks)
    if dev.type == "cuda":
        step = {
            g: timed(lambda g=g: _run_stacked(layer, rows, offsets, counts, upstream, g), reps=5) for g in (True, False)
        }
        figures.update(grouped_s=step[True], loop_s=step[False])
        checks.check("grouped_mm forward+backward time / per-expert loop's", step[True] / step[False], "<=", 1.0)
    else:
        checks.skip("grouped_mm faster than the loop", "timing means nothing off a GPU")
    return figures


def _run_stacked(layer, rows, offsets, counts, upstream, grouped: bool) -> tuple:
    layer.grouped = grouped
    layer.weight.grad = None
    x = rows.clone().requires_grad_()
    out = layer(x, offsets, counts)
    (out.float() * upstream).sum().backward()
    return out.detach(), x.grad, layer.weight.grad


def _fp32_loop(weight, rows, counts, upstream) -> tuple:
    import torch

    w = weight.float().requires_grad_()
    x = rows.float().requires_grad_()
    out = torch.cat([group @ w[e].t() for e, group in enumerate(x.split(counts))])
    (out * upstream).sum().backward()
    return out.detach(), x.grad, w.grad


def _no_rows_check(layer, offsets, checks: Checks) -> None:
    """A rank whose experts got no token at all: an empty output and zero weight gradients."""
    import torch

    layer.grouped, layer.weight.grad = True, None
    x = torch.zeros(0, layer.weight.shape[2], device=layer.weight.device, dtype=layer.weight.dtype, requires_grad=True)
    out = layer(x, torch.zeros_like(offsets), [0] * layer.weight.shape[0])
    (out.float().sum() + 0 * layer.weight.float().sum()).backward()
    checks.check("no rows at all: output rows", out.shape[0], "==", 0)
    checks.check("no rows at all: weight grad", float(layer.weight.grad.abs().max()), "==", 0.0)


def recomputed_attention_check(mode: str, checks: Checks, work: Path) -> dict:
    """A tiny Qwen3-MoE with and without full activation recompute: every attention call
    (forward and recompute) must be causal with no mask tensor, and the gradients equal; on
    CUDA the recomputed model must also run with only the flash kernel allowed."""
    import torch

    from moe_rl.models.architectures import load_hf_config
    from moe_rl.models.layers import LayerModules
    from moe_rl.models.tiny import save_tiny_checkpoint

    hf_dir = save_tiny_checkpoint(work / "attn", "qwen3_moe", seed=1, vocab_size=97)
    hf_config = load_hf_config(hf_dir)
    dtype = torch.bfloat16 if cuda() else torch.float32
    batches = _batches([24, 17, 9] if mode == "smoke" else [128, 100, 77])
    calls: dict[str, list] = {}
    with one_rank(hf_config) as layout, _recording_sdpa() as log:
        for name, overrides in (("plain", {}), ("recompute", FULL_RECOMPUTE)):
            log.clear()
            calls[name] = (
                logprobs_and_grads(hf_config, hf_dir, layout, batches, LayerModules(), dtype, **overrides),
                list(log),
            )
        for name, overrides in (("plain", {}), ("recomputed", FULL_RECOMPUTE)):
            what = f"{name} layers run with only the flash kernel allowed"
            if not cuda():
                checks.skip(what, "flash-only is a CUDA check")
                continue
            from torch.nn.attention import SDPBackend, sdpa_kernel

            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    logprobs_and_grads(hf_config, hf_dir, layout, batches, LayerModules(), dtype, **overrides)
                checks.check(what, True, "==", True)
            except RuntimeError as e:
                checks.fail(what, str(e)[:300])
    plain, recompute = calls["plain"][1], calls["recompute"][1]
    checks.check(
        "attention calls with a mask tensor (plain + recompute)", sum(not c for c in plain + recompute), "==", 0
    )
    rerun, expected = len(recompute) - len(plain), hf_config.num_hidden_layers * len(batches)
    checks.check("attention calls the recompute re-ran (layers x micro-batches)", rerun, "==", expected)
    (lp_a, g_a, _), (lp_b, g_b, _) = calls["plain"][0], calls["recompute"][0]
    # equal but for the order of the MoE combine's atomic adds on CUDA (a bf16 rounding apart)
    fp32 = dtype == torch.float32
    checks.check("recompute log-probs vs plain (abs)", float((lp_a - lp_b).abs().max()), "<=", 1e-6 if fp32 else 2e-2)
    worst = max(rel_err(g_b[k], g_a[k]) for k in g_a)
    checks.check("recompute grads vs plain (rel)", worst, "<=", 1e-5 if fp32 else BF16_REL)
    return {"dtype": str(dtype), "attention_calls": {"plain": len(plain), "recompute": len(recompute)}}


class _recording_sdpa:
    """Records, for every ``scaled_dot_product_attention`` call, whether it was causal with no mask."""

    def __enter__(self) -> list:
        import torch.nn.functional as F

        self.original, log = F.scaled_dot_product_attention, []

        def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            log.append(attn_mask is None and is_causal)
            return self.original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

        F.scaled_dot_product_attention = recording
        return log

    def __exit__(self, *exc) -> None:
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self.original


def _batches(lengths: list[int], vocab: int = 97, count: int = 2) -> list:
    import torch

    from moe_rl.models.forward import MicroBatch

    gen = torch.Generator().manual_seed(0)
    shape = (len(lengths), max(lengths))
    return [
        MicroBatch(torch.randint(0, vocab, shape, generator=gen), lengths=torch.tensor(lengths)) for _ in range(count)
    ]


def _weighted_logp_loss(out, mb) -> tuple:
    """A loss whose gradient differs by position: the log-probs weighted 0.5 .. 1.5."""
    import torch

    logp = out[..., 0]
    return -(logp * torch.linspace(0.5, 1.5, logp.shape[-1], device=logp.device, dtype=logp.dtype)).sum() / 100, {}


def logprobs_and_grads(hf_config, hf_dir, layout, batches, modules, dtype, **overrides) -> tuple:
    """The model built with ``modules`` in ``dtype`` from ``hf_dir``'s weights: its log-probs
    of ``batches``, the HF-named gradients of a weighted log-prob loss, its TE module count."""
    import torch

    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import run_microbatches
    from moe_rl.models.hf_weights import gather_hf_tensors, load_hf_weights
    from parallel.optim import OptimSettings, wrap_ddp

    config = make_transformer_config(hf_config, layout, params_dtype=dtype, modules=modules, **overrides)
    model = build_model(hf_config, config, modules=modules)
    load_hf_weights(model, hf_config, hf_dir)
    te_modules = sum(type(m).__module__.startswith("transformer_engine") for m in model.modules())
    ddp = wrap_ddp(model, config, OptimSettings())
    logp = torch.cat([r["logprobs"].float() for r in run_microbatches([ddp], batches, forward_only=True)])
    ddp.zero_grad_buffer()
    run_microbatches([ddp], batches, loss_fn=_weighted_logp_loss, forward_only=False)
    return logp, gather_hf_tensors(model, hf_config, source=lambda name, p: p.main_grad.float()), te_modules


# ----------------------------------------------------------------------- log-prob head


def stage_logprob(mode: str, checks: Checks, work: Path) -> dict:
    """The chunked log-prob + entropy head: its peak memory against full fp32 logits, which
    fp32-logits path runs, and its log-prob error and gradient error against fp64."""
    import torch

    from moe_rl.models.logprob_head import LogProbConfig, has_fp32_output_matmul, vocab_parallel_logprobs

    vocab, tokens, hidden = {"smoke": (4096, 256, 64), "quick": (151_936, 1024, 2048)}.get(mode, (151_936, 4096, 2048))
    dev, gen = device(), torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(vocab, hidden, generator=gen)).to(dev, torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens, 1), generator=gen).to(dev)
    states = torch.randn(tokens, 1, hidden, generator=gen).to(dev, torch.bfloat16)
    figures = {"vocab": vocab, "tokens": tokens, "full_logits_fp32_mb": vocab * tokens * 4 / 2**20}
    for variant in ("chunked", "full_logits"):
        h = states.clone().requires_grad_(True)
        base = peak_mb(reset=True)
        if variant == "chunked":
            logp, entropy = vocab_parallel_logprobs(h, weight, targets, config=LogProbConfig(chunk_size=512))
        else:
            logp_all = torch.log_softmax((h @ weight.t()).float(), -1)
            logp, entropy = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
        (logp.sum() + entropy.sum()).backward()
        sync()
        figures[f"{variant}_peak_extra_mb"] = peak_mb() - base
        weight.grad = None
    if cuda():
        # both hold the output weight's gradient (bf16, vocab x hidden: 622 MB, as large as
        # 1,024 tokens' fp32 logits): the logits' own memory is what the chunks save
        grad_mb = vocab * hidden * 2 / 2**20
        figures["weight_grad_mb"] = grad_mb
        ratio = (figures["chunked_peak_extra_mb"] - grad_mb) / (figures["full_logits_peak_extra_mb"] - grad_mb)
        checks.check("chunked head's peak memory / full fp32 logits' (less the weight gradient)", ratio, "<=", 0.25)
        checks.check(
            "fp32 logits from torch.mm(out_dtype=fp32)", has_fp32_output_matmul("cuda", torch.bfloat16), "==", True
        )
    else:
        checks.skip("chunked head's peak memory / full fp32 logits'", "no device memory to measure")
        checks.skip("fp32 logits from torch.mm(out_dtype=fp32)", "a CUDA path (the CPU upcasts)")
    figures.update(_against_fp64(weight.detach(), states[:512], targets[:512], checks))
    return figures


def _against_fp64(weight, states, targets, checks: Checks) -> dict:
    import torch

    from moe_rl.models.logprob_head import (
        LogProbConfig,
        fp32_logits,
        has_fp32_accumulating_addmm,
        vocab_parallel_logprobs,
    )

    def exact_logp(h, w):
        return torch.log_softmax(h @ w.t(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    h64, w64 = states.double().requires_grad_(True), weight.double()
    exact = exact_logp(h64, w64)
    exact.sum().backward()
    rounded = torch.log_softmax((states @ weight.t()).double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    h = states.clone().requires_grad_(True)
    ours, _ = vocab_parallel_logprobs(h, weight, targets, config=LogProbConfig(chunk_size=512))
    ours.sum().backward()
    err, err_bf16 = float((ours.double() - exact).abs().max()), float((rounded - exact.detach()).abs().max())
    checks.check("log-prob max error vs fp64 (nats)", err, "<=", 1e-3)
    checks.check("log-prob error / bf16 logits' error", err / max(err_bf16, 1e-30), "<=", 0.1)
    checks.check("hidden-state grad vs fp64 (rel)", rel_err(h.grad, h64.grad), "<=", BF16_GRAD_REL)
    weight_errors = _output_weight_grad_errors(weight, states, targets, w64, exact_logp)
    checks.check("output weight's main_grad vs fp64 (rel), 32 chunks", weight_errors["main_grad"], "<=", BF16_GRAD_REL)
    return {
        "output_weight_grad_rel_err_main_grad": weight_errors["main_grad"],
        "output_weight_grad_rel_err_bf16_sum": weight_errors["bf16_sum"],
        "fp32_accumulating_addmm": has_fp32_accumulating_addmm(states.device.type, states.dtype),
        "logp_max_err": err,
        "logp_max_err_if_bf16_logits": err_bf16,
        "fp32_logits_s": timed(lambda: fp32_logits(states, weight)),
        "bf16_logits_s": timed(lambda: states @ weight.t()),
    }


def _output_weight_grad_errors(weight, states, targets, w64, exact_logp) -> dict:
    """The output weight's gradient over 32 chunks against fp64: summed in fp32 into a
    megatron-style ``main_grad``, and by autograd in bf16 (a weight without one)."""
    import torch

    from moe_rl.models.logprob_head import LogProbConfig, vocab_parallel_logprobs

    w64 = w64.detach().requires_grad_(True)
    exact_logp(states.double(), w64).sum().backward()
    errors = {}
    for name in ("main_grad", "bf16_sum"):
        w = weight.detach().clone().requires_grad_(True)
        if name == "main_grad":  # the attributes megatron's DDP gives its parameters
            w.main_grad, w.grad_added_to_main_grad = torch.zeros(w.shape, device=w.device), False
        cfg = LogProbConfig(chunk_size=max(1, states.shape[0] // 32))
        vocab_parallel_logprobs(states, w, targets, config=cfg)[0].sum().backward()
        errors[name] = rel_err(w.main_grad if name == "main_grad" else w.grad, w64.grad)
    return errors


# ----------------------------------------------------------------------- parity


def stage_parity(mode: str, checks: Checks, work: Path) -> dict:
    """megatron-core's log-probs of tiny checkpoints against transformers' on the same
    weights: fp32 against fp32, and bf16 against transformers' own bf16 error."""
    families = {"smoke": ["qwen3_moe"], "quick": ["qwen3_moe", "deepseek_v3"]}.get(
        mode, ["qwen3_moe", "glm4_moe", "deepseek_v3"]
    )
    return {family: _parity_of(family, work, checks) for family in families}


def _parity_of(family: str, work: Path, checks: Checks) -> dict:
    import torch

    from moe_rl.commands.parity import transformers_logprobs
    from moe_rl.models.architectures import load_hf_config
    from moe_rl.models.tiny import save_tiny_checkpoint

    hf_dir = save_tiny_checkpoint(work / family, family, seed=1, vocab_size=97)
    hf_config = load_hf_config(hf_dir)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    reference, _ = transformers_logprobs(hf_dir, ids)  # fp32, on the CPU
    hf_bf16 = _transformers_bf16(hf_dir, ids)
    with one_rank(hf_config) as layout:
        ours = {
            dtype: _megatron_logprobs(hf_config, hf_dir, layout, ids, dtype)
            for dtype in (torch.float32, torch.bfloat16)
        }
    fp32_err = float((ours[torch.float32] - reference).abs().max())
    errs = {who: (lp - reference).abs() for who, lp in (("megatron", ours[torch.bfloat16]), ("transformers", hf_bf16))}
    mean = {who: float(e.mean()) for who, e in errs.items()}
    worst = {who: float(e.max()) for who, e in errs.items()}
    checks.check(f"{family} fp32 max |logp - transformers fp32|", fp32_err, "<=", 1e-4)
    limit = 2 * mean["transformers"] + 1e-3
    checks.check(
        f"{family} bf16 mean |logp - transformers fp32|", mean["megatron"], "<=", limit, "2x transformers' bf16 + 1e-3"
    )
    limit = 3 * worst["transformers"] + 1e-2
    checks.check(
        f"{family} bf16 max |logp - transformers fp32|", worst["megatron"], "<=", limit, "3x transformers' bf16 + 1e-2"
    )
    return {"fp32_max_err": fp32_err, "bf16_mean_err": mean, "bf16_max_err": worst}


def _transformers_bf16(hf_dir: str, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, local_files_only=True).to(device())
    model.eval()
    with torch.no_grad():
        logits = model(ids.to(device())).logits.float()[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None].to(device())).squeeze(-1).cpu()


def _megatron_logprobs(hf_config, hf_dir, layout, ids, dtype):
    import torch

    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights

    model = build_model(hf_config, make_transformer_config(hf_config, layout, params_dtype=dtype))
    load_hf_weights(model, hf_config, hf_dir)
    model.eval()
    results = run_microbatches(model, [MicroBatch(ids[i : i + 1]) for i in range(ids.shape[0])])
    return torch.cat([r["logprobs"].float().cpu() for r in results])


# ----------------------------------------------------------------------- fusions


def stage_fusions(mode: str, checks: Checks, work: Path) -> dict:
    """Transformer Engine's layers against the local spec (where TE imports), and torch's
    fused AdamW against its multi-tensor form (through megatron's optimizer, and alone)."""
    from moe_rl.models.architectures import load_hf_config
    from moe_rl.models.tiny import save_tiny_checkpoint

    hf_dir = save_tiny_checkpoint(work / "hf", "qwen3_moe", seed=1, vocab_size=97)
    hf_config = load_hf_config(hf_dir)
    batches = _batches([24, 17, 9] if mode == "smoke" else [256, 200, 77, 128])
    with one_rank(hf_config) as layout:
        te = _transformer_engine_parity(hf_config, hf_dir, layout, batches, checks)
        adam = fused_adam_check(hf_config, hf_dir, layout, batches, checks)
    return {"transformer_engine": te, "megatron_adam": adam, "torch_adam": torch_adam_check(checks)}


def _transformer_engine_parity(hf_config, hf_dir, layout, batches, checks: Checks) -> dict:
    import torch

    from moe_rl.models.layers import LayerModules, transformer_engine_usable

    if not transformer_engine_usable():
        checks.skip("transformer_engine vs local", "Transformer Engine does not import here (or no GPU)")
        return {"ran": False}
    out: dict = {"ran": True}
    for dtype in (torch.float32, torch.bfloat16):
        local, te = (
            logprobs_and_grads(hf_config, hf_dir, layout, batches, LayerModules(transformer_impl=impl), dtype)
            for impl in ("local", "transformer_engine")
        )
        name = str(dtype).removeprefix("torch.")
        worst = max(rel_err(te[1][k], local[1][k]) for k in local[1])
        limits = (1e-3, 1e-3) if dtype == torch.float32 else (5e-2, 5e-2)
        checks.check(f"TE {name}: its modules in the model", te[2], ">", 0)
        checks.check(f"TE {name}: max |logp - local|", float((local[0] - te[0]).abs().max()), "<=", limits[0])
        checks.check(f"TE {name}: grads vs local (rel)", worst, "<=", limits[1])
        out[name] = {"te_modules": te[2]}
    return out


def fused_adam_check(hf_config, hf_dir, layout, batches, checks: Checks, steps: int = 3) -> dict:
    """megatron's optimizer (fp32 weights) stepped ``steps`` times with torch's fused AdamW and
    with its multi-tensor form from the same weights and batches. Compared only where the two
    runs really took the two kernels (TE's / apex's fused Adam ignores the choice)."""
    import torch

    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    weights, kernels = {}, {}
    for fused in (True, False):
        config = make_transformer_config(hf_config, layout, params_dtype=torch.float32)
        model = build_model(hf_config, config)
        load_hf_weights(model, hf_config, hf_dir)
        settings = OptimSettings(lr=1e-3, fused_adam=fused)
        ddp = wrap_ddp(model, config, settings)
        optimizer = build_optimizer([ddp], settings)
        for _ in range(steps):
            train_step(
                [ddp],
                optimizer,
                lambda: run_microbatches([ddp], batches, loss_fn=_weighted_logp_loss, forward_only=False),
            )
        weights[fused] = {n: p.detach().clone() for n, p in model.named_parameters()}
        kernels[fused] = sorted(
            {
                f"{type(part.optimizer).__name__} fused={g.get('fused')} foreach={g.get('foreach')}"
                for part in getattr(optimizer, "chained_optimizers", [optimizer])
                for g in part.optimizer.param_groups
            }
        )
    figures = {"fused": kernels[True], "foreach": kernels[False]}
    took_both = all("fused=True foreach=False" in k for k in kernels[True]) and all(
        "fused=False foreach=True" in k for k in kernels[False]
    )
    if not took_both:
        checks.skip("megatron Adam fused vs foreach", f"the two runs did not take the two kernels: {figures}")
        return figures
    diff = max(float((weights[True][n] - weights[False][n]).abs().max()) for n in weights[True])
    checks.check(f"megatron Adam fused vs foreach: weights after {steps} steps (abs)", diff, "<=", 1e-5)
    return figures | {"max_abs_diff": diff}


def torch_adam_check(checks: Checks, steps: int = 5, lr: float = 1e-3, weight_decay: float = 0.01) -> dict:
    """torch's AdamW, fused and multi-tensor, on the same fp32 tensors and gradients: the
    weights after ``steps`` steps (copied before the kernels are timed, which steps them on)
    within one fp32 rounding per step either way at the largest weight's magnitude. A
    multi-tensor run without the weight decay must land outside that bound (the bound can fail)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    shapes = [(1024, 1024), (4096,), (256, 3, 64)]
    start = [torch.randn(s, generator=gen).to(device()) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(device()) for s in shapes] for _ in range(steps)]
    final, seconds = {}, {}
    for name, fused, decay in (
        ("fused", True, weight_decay),
        ("foreach", False, weight_decay),
        ("no_decay", False, 0.0),
    ):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        adam = torch.optim.AdamW(params, lr=lr, weight_decay=decay, fused=fused, foreach=not fused)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g
            adam.step()
        final[name] = [p.detach().clone() for p in params]
        if name != "no_decay":
            seconds[name] = timed(adam.step, reps=5)

    def max_diff(a: str, b: str) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(final[a], final[b]))

    largest = max(float(t.abs().max()) for t in final["foreach"])
    bound = 2 * steps * 2**-23 * largest  # fp32: an ulp of |w| is at most 2^-23 |w|
    diff, without_decay = max_diff("fused", "foreach"), max_diff("no_decay", "foreach")
    checks.check(f"torch AdamW fused vs foreach: weights after {steps} steps (abs)", diff, "<=", bound)
    checks.check("torch AdamW: a missing weight decay exceeds that bound (abs)", without_decay, ">", bound)
    return {
        "max_abs_diff": diff,
        "bound": bound,
        "without_decay_max_abs_diff": without_decay,
        "fused_step_s": seconds["fused"],
        "foreach_step_s": seconds["foreach"],
    }
