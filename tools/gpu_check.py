"""What moe-rl does on a CUDA machine, in one run of a few minutes: writes gpu_check.json.

Stages (each in its own process, with a time limit; a failed stage is recorded with the
end of its output and the others still run):

- ``env``: torch / CUDA / GPU / package versions;
- ``matmul``: the bf16 matmul rate this GPU reaches (the MFU denominator);
- ``parity``: ``moe-rl parity`` (fp32) of tiny Qwen3-MoE, GLM-4.5 and DeepSeek-V3 (MLA) checkpoints;
- ``train``: 3 steps of the built-in model (bf16) with R2, then R3 with activation
  recompute (the recomputed attention must take the forward's kernel path), then the R2
  run resumed to step 4;
- ``colocated``: 2 steps against the project's SGLang-protocol stand-in server on the
  same GPU (``tests/sglang_test_server.py``; no SGLang needed): colocated (the trainer's
  state offloaded and ``empty_cache``'d around each rollout), CUDA-IPC tensor weight sync,
  R3 from the server's routing;
- ``big_moe``: a ~1.3B-parameter MoE made on the fly (16 layers x 64 experts, top-8,
  hidden 1024): optimizer-step time over 4 x 2048 tokens and its MFU;
- ``logprob_memory``: peak memory of the chunked log-prob + entropy head (forward and
  backward) at vocab 151,936 x 4,096 tokens against full logits; which fp32-logits path
  runs (``torch.mm(out_dtype=fp32)`` or an upcast), its time against bf16 logits and its
  log-prob error against fp64;
- ``kernels``: what the layer modules would get on this GPU: torch's ``grouped_mm`` for
  ``GroupedExperts`` (equal to one matmul per expert? faster?; the experts use it only on
  CPU until this says so) and which ``scaled_dot_product_attention`` backends run
  ``SdpaAttention``'s causal GQA and MLA shapes; whether a recomputed layer's mask still
  selects the causal path. ``grouped_mm`` forward and backward against the per-expert
  loop, and whether ``StackedLinear`` picks it on this GPU by itself (bf16, SM90+);
- ``fusions``: ``model.transformer_impl=transformer_engine`` against ``local`` on the same
  weights (log-probs and gradients, fp32 and bf16; only where Transformer Engine imports),
  and torch's fused AdamW against its multi-tensor form over a few megatron optimizer steps
  (weights after them, step time).

    python tools/gpu_check.py [--out gpu_check.json] [--smoke]

``--smoke`` shrinks every size so the script itself can be exercised on a CPU machine
(the numbers then mean nothing). ``tools/gpu_check.sh`` installs missing packages from
``wheels/`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("env", "matmul", "parity", "train", "colocated", "big_moe", "logprob_memory", "kernels", "fusions")
LIMITS_S = {
    "env": 60,
    "matmul": 60,
    "parity": 240,
    "train": 480,
    "colocated": 300,
    "big_moe": 180,
    "logprob_memory": 120,
    "kernels": 90,
    "fusions": 180,
}


def _device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_mb(reset: bool = False) -> float:
    import torch

    if not torch.cuda.is_available():
        return 0.0
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated() / 2**20


def _timed(fn, reps: int = 5, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` over ``reps`` calls after ``warmup`` ones (device synced)."""
    for _ in range(warmup):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - start) / reps


def _cli(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


# ----------------------------------------------------------------------- stages


def stage_env(smoke: bool, work: Path) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "cuda_version": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=list(torch.cuda.get_device_capability()),
            bf16=torch.cuda.is_bf16_supported(),
        )
    for name in ("megatron.core", "transformers", "deepspeed", "transformer_engine", "sglang"):
        try:
            module = __import__(name, fromlist=["__version__"])
            out[name] = getattr(module, "__version__", "?")
        except Exception as e:  # noqa: BLE001 (a report, not a check)
            out[name] = f"missing ({type(e).__name__})"
    return out


def stage_matmul(smoke: bool, work: Path) -> dict:
    import torch

    n, dtype = (256, torch.float32) if smoke else (8192, torch.bfloat16)
    a = torch.randn(n, n, device=_device(), dtype=dtype)
    b = torch.randn(n, n, device=_device(), dtype=dtype)
    seconds = _timed(lambda: a @ b, reps=20, warmup=3)
    return {"n": n, "dtype": str(dtype), "tflops": 2 * n**3 / seconds / 1e12}


def stage_parity(smoke: bool, work: Path) -> dict:
    from moe_rl.models.tiny import save_tiny_checkpoint

    out = {}
    for family in ("qwen3_moe", "glm4_moe", "deepseek_v3"):
        path = save_tiny_checkpoint(work / family, family, seed=1, vocab_size=97)
        run = _cli("parity", "--hf-dir", path, "--tolerance", "1e-4", timeout=120)
        line = next((l for l in run.stdout.splitlines() if l.startswith("parity")), run.stderr[-400:])
        out[family] = {"ok": run.returncode == 0, "line": line}
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


TINY_RUN = [
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "warm_start.steps=20",
    "warm_start.batch_size=32",
    "train.progress=false",
    "algorithm.updates_per_batch=2",
]


def _train(run_dir: Path, cache: Path, steps: int, *extra: str) -> dict:
    run = _cli(
        "train",
        *TINY_RUN,
        f"train.steps={steps}",
        f"train.run_dir={run_dir}",
        f"warm_start.cache_dir={cache}",
        *extra,
        timeout=240,
    )
    rows = (
        [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    keep = (
        "train/loss",
        "train/logp_mismatch_mean",
        "routing/train_vs_rollout/changed_frac/mean",
        "routing/replayed/changed_frac/mean",
        "perf/step_time_s",
        "perf/peak_memory_mb",
    )
    return {
        "ok": run.returncode == 0,
        "steps": [r["step"] for r in rows],
        "last": {k: rows[-1].get(k) for k in keep} if rows else {},
        "error": None if run.returncode == 0 else run.stderr[-800:],
    }


def stage_train(smoke: bool, work: Path) -> dict:
    cache = work / "cache"
    out = {
        "r2": _train(work / "r2", cache, 3, "routing.replay=r2"),
        "r3_recompute": _train(work / "r3", cache, 3, "routing.replay=r3", "routing.recompute_activations=true"),
    }
    out["r2_resumed"] = _train(work / "r2", cache, 4, "routing.replay=r2")
    out["ok"] = all(v["ok"] for v in out.values()) and out["r2_resumed"]["steps"] == [1, 2, 3, 4]
    return out


def stage_colocated(smoke: bool, work: Path) -> dict:
    from moe_rl.config import load_config
    from moe_rl.rollout.server import ServerSettings, SGLangServer
    from moe_rl.trainer.demo_model import demo_model_dir
    from parallel.launch import free_port

    cache = work / "cache"
    prepared = _cli("prepare", *TINY_RUN, f"warm_start.cache_dir={cache}", timeout=120)
    if prepared.returncode != 0:
        return {"ok": False, "error": prepared.stderr[-1500:]}
    model = demo_model_dir(load_config(None, [*TINY_RUN, f"warm_start.cache_dir={cache}"]))
    stand_in = [sys.executable, "-W", "ignore", str(ROOT / "tests" / "sglang_test_server.py")]
    settings = ServerSettings(
        model_path=str(model),
        port=free_port(),
        return_routed_experts=True,
        deterministic=True,
        memory_saver=True,
        launch_command=stand_in,
    )
    server = SGLangServer(settings, work / "logs")
    try:
        server.wait_healthy(timeout_s=120)
        args = [
            "train",
            *TINY_RUN,
            "train.steps=2",
            f"train.run_dir={work / 'run'}",
            f"warm_start.cache_dir={cache}",
            "rollout.engine=sglang",
            f"rollout.sglang_urls=[{server.url}]",
            "rollout.weight_sync=tensor",
            "rollout.colocate=true",
            "routing.replay=r3",
            "routing.recompute_activations=true",
        ]
        env = {
            **os.environ,
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        with open(
            work / "train.log", "w"
        ) as log:  # a file, not a pipe: the tensor sync's shared-memory manager may outlive the run
            code = subprocess.run(
                [sys.executable, "-m", "moe_rl.cli", *args], stdout=log, stderr=log, timeout=240, env=env, cwd=ROOT
            ).returncode
    finally:
        server.stop()
    rows = (
        [json.loads(l) for l in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        if (work / "run" / "metrics.jsonl").exists()
        else []
    )
    keep = (
        "train/loss",
        "train/logp_mismatch_max",
        "routing/train_vs_rollout/changed_frac/mean",
        "perf/peak_memory_mb",
    )
    return {
        "ok": code == 0 and len(rows) == 2,
        "last": {k: rows[-1].get(k) for k in keep} if rows else {},
        "error": None if code == 0 else (work / "train.log").read_text()[-1500:],
    }


def stage_big_moe(smoke: bool, work: Path) -> dict:
    import torch

    from moe_rl.models.architectures import model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.tiny import tiny_config
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.layout import ParallelLayout
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    sizes = (64, 2, 8, 2, 32, 512, 128, 2, 4, 2) if smoke else (1024, 16, 64, 8, 384, 32768, 2048, 4, 16, 4)
    h, layers, experts, k, ffn, vocab, seq, batch, heads, kv = sizes
    head_dim = h // heads
    hf_config = tiny_config(
        "qwen3_moe",
        vocab_size=vocab,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=ffn,
        intermediate_size=4 * ffn,
        max_position_embeddings=seq,
    )
    layout = ParallelLayout()
    init_distributed(layout, model_dims(hf_config), seed=0)
    try:
        config = make_transformer_config(hf_config, layout)
        model = build_model(hf_config, config)
        settings = OptimSettings(lr=1e-5)
        ddp = wrap_ddp(model, config, settings)
        optimizer = build_optimizer([ddp], settings)
        total = sum(p.numel() for p in model.parameters())
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(_device())
        batches = [MicroBatch(ids[i : i + 1]) for i in range(batch)]

        def loss_fn(out, mb):
            loss = -out[..., 0].mean() / batch
            return loss, {"loss": loss.detach()}

        step = lambda: train_step(
            [ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False)
        )  # noqa: E731
        step()
        _peak_mb(reset=True)
        seconds = _timed(step, reps=3, warmup=0)
    finally:
        destroy_distributed()
    # active parameters per token: attention, router, k of the experts, the output layer
    attention = layers * (h * head_dim * (heads + 2 * kv) + heads * head_dim * h)
    active = attention + layers * (h * experts + k * 3 * h * ffn) + vocab * h
    tokens = batch * seq
    flops = 6 * active * tokens + 12 * layers * heads * head_dim * seq * tokens / 2  # causal attention scores
    return {
        "total_params": total,
        "active_params": active,
        "tokens": tokens,
        "step_s": seconds,
        "tflops": flops / seconds / 1e12,
        "peak_mb": _peak_mb(),
    }


def stage_logprob_memory(smoke: bool, work: Path) -> dict:
    import torch

    from moe_rl.models.logprob_head import LogProbConfig, vocab_parallel_logprobs

    vocab, seq, hidden = (4096, 256, 64) if smoke else (151_936, 4096, 2048)
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(vocab, hidden, generator=gen)).to(_device(), dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (seq, 1), generator=gen).to(_device())
    out = {"vocab": vocab, "tokens": seq, "full_logits_fp32_mb": vocab * seq * 4 / 2**20}
    for variant in ("chunked", "full_logits"):
        hidden_states = torch.randn(seq, 1, hidden, generator=gen).to(_device(), dtype).requires_grad_(True)
        base = _peak_mb(reset=True)
        start = time.perf_counter()
        if variant == "chunked":
            logp, entropy = vocab_parallel_logprobs(
                hidden_states, weight, targets, config=LogProbConfig(chunk_size=512)
            )
        else:
            logits = (hidden_states @ weight.t()).float()
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        (logp.sum() + entropy.sum()).backward()
        _sync()
        out[variant] = {"peak_extra_mb": _peak_mb() - base, "seconds": time.perf_counter() - start}
        weight.grad = None
    out["fp32_logits"] = _fp32_logits_check(weight.detach(), hidden_states.detach(), targets)
    return out


def _fp32_logits_check(weight, hidden_states, targets) -> dict:
    """Which fp32-logits path runs, what it costs against bf16 logits, and the log-prob
    error of each against fp64."""
    import torch

    from moe_rl.models.logprob_head import LogProbConfig, fp32_logits, has_fp32_output_matmul, vocab_parallel_logprobs

    h = hidden_states[:512]
    t = targets[:512]
    exact = torch.log_softmax(h.double() @ weight.double().t(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    rounded = torch.log_softmax((h @ weight.t()).double(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ours, _ = vocab_parallel_logprobs(h, weight, t, config=LogProbConfig(chunk_size=512))
    return {
        "path": "mm_out_dtype_fp32"
        if has_fp32_output_matmul(weight.device.type, weight.dtype)
        else ("fp32" if weight.dtype == torch.float32 else "upcast"),
        "fp32_s": _timed(lambda: fp32_logits(h, weight)),
        "activation_dtype_s": _timed(lambda: h @ weight.t()),
        "logp_max_err": float((ours.double() - exact).abs().max()),
        "logp_max_err_if_bf16_logits": float((rounded - exact).abs().max()),
    }


def stage_kernels(smoke: bool, work: Path) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moe_rl.models.grouped_experts import StackedLinear

    device, dtype = _device(), (torch.float32 if smoke else torch.bfloat16)
    experts, rows, hidden, ffn = (4, 64, 64, 32) if smoke else (16, 8192, 2048, 768)
    config = SimpleNamespace(use_cpu_initialization=device.type == "cpu", params_dtype=dtype)
    layer = StackedLinear(experts, 2 * ffn, hidden, config, partition_dim=1)
    torch.nn.init.normal_(layer.weight, std=hidden**-0.5)
    counts = torch.full((experts,), rows // experts)
    offsets, sizes = counts.cumsum(0).to(device=device, dtype=torch.int32), counts.tolist()
    x = torch.randn(rows, hidden, device=device, dtype=dtype)

    chosen = layer.grouped  # StackedLinear's own decision on this device and dtype

    def run(grouped: bool) -> torch.Tensor:
        layer.grouped = grouped
        return layer(x, offsets, sizes)

    def grads(grouped: bool) -> list[torch.Tensor]:
        layer.weight.grad = None
        rows_in = x.clone().requires_grad_()
        layer.grouped = grouped
        (layer(rows_in, offsets, sizes).float() * upstream).sum().backward()
        return [rows_in.grad, layer.weight.grad]

    upstream = torch.randn(rows, 2 * ffn, device=device)
    layer.weight.requires_grad_(True)
    out: dict = {
        "grouped_mm": {
            "rows": rows,
            "experts": experts,
            "chosen_by_default": chosen,
            "loop_s": _timed(lambda: run(False)),
        }
    }
    try:
        out["grouped_mm"].update(
            ok=True, max_diff=float((run(True) - run(False)).abs().max()), grouped_s=_timed(lambda: run(True))
        )
        out["grouped_mm"]["grad_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(grads(True), grads(False)))
    except Exception as e:  # noqa: BLE001 (a report)
        out["grouped_mm"].update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    from megatron.core.tensor_parallel.random import detach_variable

    from moe_rl.models.layers import causal_mask, is_shared_causal_mask

    # activation recompute re-enters attention with a detached copy of the mask: it must still
    # take the is_causal (flash/efficient) path, not the explicit-mask math kernel
    (recomputed,) = detach_variable((causal_mask(128, device),))
    out["recomputed_mask_takes_causal_path"] = is_shared_causal_mask(recomputed)
    seq, heads, groups = (64, 4, 2) if smoke else (4096, 32, 4)
    for name, (d_qk, d_v, kv_heads) in {"gqa": (128, 128, groups), "mla": (192, 128, heads)}.items():
        q = torch.randn(1, heads, seq, d_qk, device=device, dtype=dtype)
        k = torch.randn(1, kv_heads, seq, d_qk, device=device, dtype=dtype)
        v = torch.randn(1, kv_heads, seq, d_v, device=device, dtype=dtype)
        backends = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel([backend]):
                    # noqa: E731
                    call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
                    base = _peak_mb(reset=True)
                    backends[backend.name] = {
                        "ok": True,
                        "seconds": _timed(call, reps=3),
                        "peak_extra_mb": _peak_mb() - base,
                    }
            except Exception as e:  # noqa: BLE001 (a report)
                backends[backend.name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        out[f"sdpa_{name}"] = backends
    return out


def stage_fusions(smoke: bool, work: Path) -> dict:
    import torch

    from moe_rl.models.architectures import load_hf_config, model_dims
    from moe_rl.models.forward import MicroBatch
    from moe_rl.models.tiny import save_tiny_checkpoint
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.layout import ParallelLayout

    hf_dir = save_tiny_checkpoint(work / "hf", "qwen3_moe", seed=1, vocab_size=97)
    hf_config, layout = load_hf_config(hf_dir), ParallelLayout()
    gen = torch.Generator().manual_seed(0)
    lengths = [24, 17, 9] if smoke else [256, 200, 77, 128]
    batches = [
        MicroBatch(torch.randint(0, 97, (len(lengths), max(lengths)), generator=gen), lengths=torch.tensor(lengths))
        for _ in range(2)
    ]
    init_distributed(layout, model_dims(hf_config), seed=0)
    try:
        out = {
            "transformer_engine": _transformer_engine_parity(hf_config, hf_dir, layout, batches),
            "fused_adam": _fused_adam_against_foreach(hf_config, hf_dir, layout, batches, steps=3),
        }
    finally:
        destroy_distributed()
    out["ok"] = out["transformer_engine"]["ok"] and out["fused_adam"]["ok"]
    return out


def _weighted_logp_loss(out, mb) -> tuple:
    """A loss whose gradient differs by position: the log-probs weighted 0.5 .. 1.5."""
    import torch

    logp = out[..., 0]
    return -(logp * torch.linspace(0.5, 1.5, logp.shape[-1], device=logp.device, dtype=logp.dtype)).sum() / 100, {}


def _logprobs_and_grads(hf_config, hf_dir, layout, batches, modules, dtype) -> tuple:
    """The model built with ``modules`` in ``dtype`` from ``hf_dir``'s weights: its log-probs
    of ``batches`` and the HF-named gradients of a weighted log-prob loss."""
    import torch

    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import run_microbatches
    from moe_rl.models.hf_weights import gather_hf_tensors, load_hf_weights
    from parallel.optim import OptimSettings, wrap_ddp

    config = make_transformer_config(hf_config, layout, params_dtype=dtype, modules=modules)
    model = build_model(hf_config, config, modules=modules)
    load_hf_weights(model, hf_config, hf_dir)
    te_modules = sum(
        type(m).__module__.startswith("transformer_engine") or type(m).__name__.startswith("TE")
        for m in model.modules()
    )
    ddp = wrap_ddp(model, config, OptimSettings())
    logp = torch.cat([r["logprobs"].float() for r in run_microbatches([ddp], batches, forward_only=True)])
    ddp.zero_grad_buffer()
    run_microbatches([ddp], batches, loss_fn=_weighted_logp_loss, forward_only=False)
    return logp, gather_hf_tensors(model, hf_config, source=lambda name, p: p.main_grad.float()), te_modules


def _transformer_engine_parity(hf_config, hf_dir, layout, batches) -> dict:
    """TE's linears and fused attention (and its fused RoPE and permutation) against the
    local spec on the same weights: log-probs and gradients, in fp32 and bf16."""
    import torch

    from moe_rl.models.layers import LayerModules, transformer_engine_usable

    if not transformer_engine_usable():
        return {"ok": True, "ran": False, "why": "Transformer Engine does not import here (or no GPU)"}
    out: dict = {"ran": True}
    for dtype in (torch.float32, torch.bfloat16):
        local, te = (
            _logprobs_and_grads(hf_config, hf_dir, layout, batches, LayerModules(transformer_impl=impl), dtype)
            for impl in ("local", "transformer_engine")
        )
        scale = max(float(g.abs().max()) for g in local[1].values())
        out[str(dtype).removeprefix("torch.")] = {
            "logp_max_diff": float((local[0] - te[0]).abs().max()),
            "grad_max_diff_over_max_grad": max(float((local[1][k] - te[1][k]).abs().max()) for k in local[1]) / scale,
            "te_modules": te[2],
            "local_te_modules": local[2],
        }
    fp32 = out["float32"]
    out["ok"] = fp32["te_modules"] > 0 and fp32["logp_max_diff"] < 1e-3 and fp32["grad_max_diff_over_max_grad"] < 1e-3
    return out


def _fused_adam_against_foreach(hf_config, hf_dir, layout, batches, steps: int) -> dict:
    """megatron's optimizer with torch's fused AdamW and with its multi-tensor form, fp32
    weights, ``steps`` steps from the same weights and batches: the weights after them and
    the step time of each (which Adam megatron took: TE's / apex's fused one ignores the
    choice)."""
    import torch

    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights
    from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

    out: dict = {}
    weights = {}
    for fused in (True, False):
        config = make_transformer_config(hf_config, layout, params_dtype=torch.float32)
        model = build_model(hf_config, config)
        load_hf_weights(model, hf_config, hf_dir)
        settings = OptimSettings(lr=1e-3, fused_adam=fused)
        ddp = wrap_ddp(model, config, settings)
        optimizer = build_optimizer([ddp], settings)
        inner = [part.optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer])]
        for _ in range(steps):
            train_step(
                [ddp],
                optimizer,
                lambda: run_microbatches([ddp], batches, loss_fn=_weighted_logp_loss, forward_only=False),
            )
        name = "fused" if fused else "foreach"
        weights[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[name] = {
            "adam": sorted({type(o).__name__ for o in inner}),
            "step_s": _timed(optimizer.step, reps=5),
            "kernels": sorted(
                {f"fused={g.get('fused')} foreach={g.get('foreach')}" for o in inner for g in o.param_groups}
            ),
        }
    out["max_abs_diff"] = max(
        float((weights["fused"][n] - weights["foreach"][n]).abs().max()) for n in weights["fused"]
    )
    out["ok"] = out["max_abs_diff"] < 1e-5
    return out


# ----------------------------------------------------------------------- driver


def run_stage(name: str, smoke: bool) -> None:
    """In a child process: one stage, its result as the last line of stdout."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as work:
        result = globals()[f"stage_{name}"](smoke, Path(work))
    print(json.dumps(result))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (exercise the script on a CPU machine)")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    p.add_argument("--only", default=",".join(STAGES), help="comma-separated stages")
    args = p.parse_args()
    if args.stage:
        run_stage(args.stage, args.smoke)
        return 0
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": args.smoke}
    for name in args.only.split(","):
        start = time.perf_counter()
        cmd = [sys.executable, "-W", "ignore", __file__, "--stage", name] + (["--smoke"] if args.smoke else [])
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMITS_S[name], cwd=ROOT)
            lines = run.stdout.strip().splitlines()
            result = (
                json.loads(lines[-1])
                if run.returncode == 0 and lines
                else {"ok": False, "error": (run.stdout + run.stderr)[-1500:]}
            )
        except subprocess.TimeoutExpired:
            result = {"ok": False, "error": f"over the {LIMITS_S[name]} s limit"}
        result.setdefault("ok", True)
        result["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = result
        print(f"[gpu_check] {name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2))  # after every stage: nothing lost on a kill
    if (
        "big_moe" in results
        and "matmul" in results
        and results["big_moe"].get("tflops")
        and results["matmul"].get("tflops")
    ):
        results["big_moe"]["mfu_vs_measured_matmul"] = results["big_moe"]["tflops"] / results["matmul"]["tflops"]
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"[gpu_check] wrote {args.out}")
    return 0 if all(r.get("ok", True) for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
