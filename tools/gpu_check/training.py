"""``tools/gpu_check/check.py``'s training stages: megatron training steps in one process (the loss
falls, a checkpoint resumes equal), the colocated offload, the trainer (``moe-rl train``: resume,
R3 + recompute, colocated against the SGLang-protocol stand-in) and the step rate of a larger MoE."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

from tools.gpu_check.common import (
    CACHE,
    ROOT,
    Checks,
    cuda,
    matmul_tflops,
    moe_rl,
    moe_step_flops,
    one_rank,
    peak_mb,
    tail,
    timed,
)

TINY_RUN = [
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "warm_start.steps=20",
    "warm_start.batch_size=32",
    "train.progress=false",
    "algorithm.updates_per_batch=2",
]
RESUME_KEYS = ("train/loss", "train/grad_norm", "reward/total")


def _model(hf_config, layout, dtype, lr: float):
    """A megatron model of ``hf_config`` in ``dtype`` (random weights), DDP and its optimizer."""
    from moe_rl.models.builder import build_model, make_transformer_config
    from parallel.optim import OptimSettings, build_optimizer, wrap_ddp

    config = make_transformer_config(hf_config, layout, params_dtype=dtype)
    model = build_model(hf_config, config)
    settings = OptimSettings(lr=lr)
    ddp = wrap_ddp(model, config, settings)
    return model, ddp, build_optimizer([ddp], settings), settings


def _nll_step(ddp, optimizer, batches) -> float:
    """One optimizer step on the mean negative log-likelihood of ``batches``; the loss."""
    import torch

    from moe_rl.models.forward import run_microbatches
    from parallel.optim import train_step

    tokens = sum(mb.input_ids[:, 1:].numel() for mb in batches)

    def loss_fn(out, mb):
        loss = -out[..., 0].float().sum() / tokens
        return loss, {"loss": loss.detach()}

    result = train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False))
    return float(torch.stack([o["loss"] for o in result.outputs]).sum()) if result.updated else math.nan


def _fixed_batches(vocab: int, count: int, seq: int, seed: int = 0) -> list:
    import torch

    from moe_rl.models.forward import MicroBatch

    gen = torch.Generator().manual_seed(seed)
    return [MicroBatch(torch.randint(0, vocab, (2, seq), generator=gen)) for _ in range(count)]


def stage_train(mode: str, checks: Checks, work: Path) -> dict:
    """Steps of megatron's optimizer on one fixed batch (bf16 on CUDA): the loss must stay finite
    and fall; a checkpoint written after ``first`` steps, loaded into a fresh model and optimizer,
    must continue as the uninterrupted run (losses and weights within 1% of the resumed steps' own
    progress: bf16 kernels with atomics are not bit-reproducible, a lost optimizer state is 10%+)."""
    import torch

    from moe_rl.checkpoint.catalog import select_checkpoint
    from moe_rl.checkpoint.store import Checkpointer, TrainingState, load_checkpoint
    from moe_rl.models.tiny import save_tiny_checkpoint, tiny_config

    hf_dir = save_tiny_checkpoint(work / "hf", "qwen3_moe", seed=1, vocab_size=97)
    hf_config, dtype = tiny_config("qwen3_moe", vocab_size=97), torch.bfloat16 if cuda() else torch.float32
    batches = _fixed_batches(97, count=2, seq=64)
    first, more = 6, 4
    with one_rank(hf_config) as layout:
        torch.manual_seed(0)
        model, ddp, optimizer, settings = _model(hf_config, layout, dtype, lr=3e-3)
        losses = [_nll_step(ddp, optimizer, batches) for _ in range(first)]
        saver = Checkpointer(work / "run", 2, layout, (hf_config, hf_dir), async_save=False)
        saver.save(first, TrainingState(model, optimizer, settings), {})
        saver.wait()
        at_save = _weights(model)
        losses += [_nll_step(ddp, optimizer, batches) for _ in range(more)]
        straight = _weights(model)
        model, ddp, optimizer, settings = _model(hf_config, layout, dtype, lr=3e-3)
        path, meta = select_checkpoint(work / "run")
        load_checkpoint(path, meta, TrainingState(model, optimizer, settings), layout)
        resumed = [_nll_step(ddp, optimizer, batches) for _ in range(more)]
        resumed_weights = _weights(model)
    checks.check("training losses finite", sum(math.isfinite(x) for x in losses + resumed), "==", 2 * more + first)
    checks.check("last loss / first loss (fixed batch)", losses[-1] / losses[0], "<=", 0.9)
    progress = abs(losses[-1] - losses[first - 1])
    worst = max(abs(a - b) for a, b in zip(losses[first:], resumed))
    checks.check("resumed losses: max |diff| / the resumed steps' loss progress", worst / progress, "<=", 0.01)
    moved = max(float((straight[k] - at_save[k]).abs().max()) for k in straight)
    off = max(float((straight[k] - resumed_weights[k]).abs().max()) for k in straight)
    checks.check("resumed weights: max |diff| / their change over the resumed steps", off / moved, "<=", 0.01)
    return {"dtype": str(dtype), "losses": losses, "resumed_losses": resumed}


def _weights(model) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------- offload


def stage_offload(mode: str, checks: Checks, work: Path) -> dict:
    """The colocated trainer's offload: a trained model's weights, gradients and optimizer state
    leave the device (the driver gets the memory back) and return bit-equal."""
    import torch

    from moe_rl.models.tiny import tiny_config
    from parallel.offload import DeviceOffloader

    sizes = (
        {}
        if mode == "smoke"
        else dict(hidden_size=1024, num_hidden_layers=4, num_experts=16, moe_intermediate_size=512)
    )
    hf_config = tiny_config("qwen3_moe", vocab_size=97 if mode == "smoke" else 32000, **sizes)
    dtype = torch.bfloat16 if cuda() else torch.float32
    with one_rank(hf_config) as layout:
        model, ddp, optimizer, _ = _model(hf_config, layout, dtype, lr=1e-3)
        batches = _fixed_batches(hf_config.vocab_size, count=1, seq=64)
        _nll_step(ddp, optimizer, batches)
        numel = sum(p.numel() for p in model.parameters())
        # weights, fp32 gradient buffers, Adam's two fp32 moments (+ fp32 master weights under bf16)
        expected = sum(p.numel() * p.element_size() for p in model.parameters()) + 4 * numel
        expected += 4 * numel * (3 if dtype == torch.bfloat16 else 2)
        before = _state(model, optimizer)
        offloader = DeviceOffloader([model], optimizer)  # as the trainer makes it (placement.py)
        free_before = torch.cuda.mem_get_info()[0] if cuda() else 0
        freed = offloader.offload()
        free_after = torch.cuda.mem_get_info()[0] if cuda() else 0
        offloader.onload()
        after = _state(model, optimizer)
        loss = _nll_step(ddp, optimizer, batches)
    checks.check("offload freed / weights + grads + Adam state", freed / expected, ">=", 0.95)
    if cuda():
        checks.check("device memory the driver got back / freed", (free_after - free_before) / freed, ">=", 0.8)
    else:
        checks.skip("device memory the driver got back / freed", "no device memory off a GPU")
    checks.check(
        "weights and optimizer state after the round trip equal", all(map(torch.equal, before, after)), "==", True
    )
    checks.check("a step after the round trip: loss finite", math.isfinite(loss), "==", True)
    return {
        "params": numel,
        "expected_mb": expected / 2**20,
        "freed_mb": freed / 2**20,
        "driver_mb": (free_after - free_before) / 2**20,
    }


def _state(model, optimizer) -> list:
    tensors = [p.detach().cpu().clone() for p in model.parameters()]
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in part.optimizer.state.values():
            tensors += [v.detach().cpu().clone() for v in state.values() if hasattr(v, "dim") and v.dim() > 0]
    return tensors


# ----------------------------------------------------------------------- the trainer


def metric_rows(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {row["step"]: row for row in rows}


def resume_differences(straight: dict[int, dict], resumed: dict[int, dict], steps: list[int]) -> dict[str, float]:
    """Per key of ``RESUME_KEYS``: the largest relative difference over ``steps`` (inf if absent)."""
    worst: dict[str, float] = {}
    for key in RESUME_KEYS:
        diffs = []
        for step in steps:
            a, b = straight.get(step, {}).get(key), resumed.get(step, {}).get(key)
            diffs.append(math.inf if a is None or b is None else abs(a - b) / max(abs(a), 1e-12))
        worst[key] = max(diffs)
    return worst


def stage_trainer(mode: str, checks: Checks, work: Path) -> dict:
    """``moe-rl train`` on this device (the built-in model): 3 steps saving at step 2, the step-2
    checkpoint resumed to step 3 (step 3 as the straight run's: rewards equal, loss and grad norm
    within 1e-3 relative: both start step 3 from the same saved weights, and the built-in model's
    top-2 combine adds exactly in any order), and (full) 2 steps of R3 with activation recompute."""
    cache, a, b = CACHE, work / "straight", work / "resumed"
    common = [*TINY_RUN, f"warm_start.cache_dir={cache}", "routing.replay=r2"]
    code = moe_rl(
        "train", *common, "train.steps=3", "train.save_every=2", f"train.run_dir={a}", log=work / "a.log", timeout=240
    )
    if not checks.check("moe-rl train exit code", code, "==", 0):
        return {"error": tail(work / "a.log")}
    shutil.copytree(a / "checkpoints" / "step_000002", b / "checkpoints" / "step_000002")
    shutil.copy(a / "metrics.jsonl", b / "metrics.jsonl")
    code = moe_rl("train", *common, "train.steps=3", f"train.run_dir={b}", log=work / "b.log", timeout=240)
    checks.check("moe-rl train (resumed) exit code", code, "==", 0)
    straight, resumed = metric_rows(a), metric_rows(b)
    checks.check(
        "straight run: losses finite",
        all(math.isfinite(r.get("train/loss", math.nan)) for s, r in straight.items() if s),
        "==",
        True,
    )
    worst = resume_differences(straight, resumed, [3])
    checks.check("resumed step 3 reward/total (rel diff)", worst["reward/total"], "==", 0.0)
    for key in ("train/loss", "train/grad_norm"):
        checks.check(f"resumed step 3 {key} (rel diff)", worst[key], "<=", 1e-3)
    figures = {"resume_rel_diff": worst, "step_3": {k: straight.get(3, {}).get(k) for k in RESUME_KEYS}}
    if mode != "quick":
        r3 = work / "r3"
        extra = ["routing.replay=r3", "routing.recompute_activations=true", "train.steps=2", f"train.run_dir={r3}"]
        code = moe_rl("train", *TINY_RUN, f"warm_start.cache_dir={cache}", *extra, log=work / "r3.log", timeout=240)
        rows = metric_rows(r3)
        checks.check("R3 + recompute: exit code", code, "==", 0)
        checks.check(
            "R3 + recompute: steps with a finite loss",
            sum(math.isfinite(r.get("train/loss", math.nan)) for s, r in rows.items() if s),
            "==",
            2,
        )
        figures["r3_recompute"] = {
            k: rows.get(2, {}).get(k) for k in ("train/loss", "train/logp_mismatch_mean", "perf/peak_memory_mb")
        }
    return figures


def stage_prepare(mode: str, checks: Checks, work: Path) -> dict:
    """The built-in model warm-started and cached once (``moe-rl prepare``) for the stages that
    train it (``trainer``, ``colocated``), so that none of them spends its own limit on it."""
    code = moe_rl("prepare", *TINY_RUN, f"warm_start.cache_dir={CACHE}", log=work / "prepare.log", timeout=200)
    checks.check("moe-rl prepare exit code", code, "==", 0)
    return {"cache": str(CACHE)} | ({} if code == 0 else {"error": tail(work / "prepare.log")})


def stage_colocated(mode: str, checks: Checks, work: Path) -> dict:
    """2 colocated steps against the SGLang-protocol stand-in on the same device: the trainer's
    state offloaded around each rollout, CUDA-IPC tensor weight sync, R3 from the server."""
    import httpx

    from moe_rl.config import load_config
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
    from moe_rl.models.demo_model import demo_model_dir
    from parallel.launch import free_port

    cache = [f"warm_start.cache_dir={CACHE}"]
    model = demo_model_dir(load_config(None, [*TINY_RUN, *cache]).demo_model())
    if not (model / "config.json").exists():  # (the prepare stage did not run, or failed)
        code = moe_rl("prepare", *TINY_RUN, *cache, log=work / "prepare.log", timeout=200)
        if not checks.check("moe-rl prepare exit code", code, "==", 0):
            return {"error": tail(work / "prepare.log")}
    stand_in = [sys.executable, "-W", "ignore", str(ROOT / "tests" / "support" / "sglang_test_server.py")]
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
        run = [
            "rollout.engine=sglang",
            f"rollout.server.urls=[{server.url}]",
            "rollout.weight_sync.method=tensor",
            "rollout.colocate=true",
        ]
        run += ["routing.replay=r3", "train.steps=2", f"train.run_dir={work / 'run'}"]
        code = moe_rl("train", *TINY_RUN, *cache, *run, log=work / "train.log", timeout=200)
        served = httpx.get(server.url + "/_test/weights_digest", timeout=60).json()["digest"] if code == 0 else None
    finally:
        server.stop()
    rows = metric_rows(work / "run")
    checks.check("colocated moe-rl train exit code", code, "==", 0)
    checks.check(
        "colocated steps with a finite loss",
        sum(math.isfinite(r.get("train/loss", math.nan)) for s, r in rows.items() if s),
        "==",
        2,
    )
    final = work / "run" / "checkpoints" / "step_000002" / "model"
    if code == 0:  # the last sync delivered step 2's weights as the trainer sent them (bf16 on CUDA)
        checks.check(
            "weights the stand-in holds equal step 2's checkpoint in the synced precision",
            served == _stand_in().weights_digest(_synced_weights(final)),
            "==",
            True,
        )
    keep = (
        "train/loss",
        "train/logp_mismatch_max",
        "routing/train_vs_rollout/changed_frac/mean",
        "perf/peak_memory_mb",
    )
    return {"last": {k: rows.get(2, {}).get(k) for k in keep}} | (
        {} if code == 0 else {"error": tail(work / "train.log")}
    )


def _stand_in():
    """tests/support/sglang_test_server.py as a module (its weights digest)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "sglang_test_server", ROOT / "tests" / "support" / "sglang_test_server.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _synced_weights(model_dir: Path):
    """The checkpoint's HF weights as the stand-in holds them after a sync: fp32, with the
    values of the precision the trainer's parameters have (bf16 on CUDA)."""
    import torch

    from moe_rl.rollout.local import LocalEngine

    precision = torch.bfloat16 if cuda() else None
    return LocalEngine(str(model_dir), weight_precision=precision).model


# ----------------------------------------------------------------------- rates


def stage_perf(mode: str, checks: Checks, work: Path) -> dict:
    """The bf16 matmul rate (H100/H200: at least 500 TFLOP/s of their ~790), and one optimizer
    step of a ~0.7B-parameter MoE (8 layers x 64 experts, top-8): finite, at least 2% MFU of it (a
    floor against host syncs and fallbacks, not a target)."""
    import torch

    tflops = matmul_tflops(256 if mode == "smoke" else 8192)
    name = torch.cuda.get_device_name() if cuda() else "cpu"
    if any(chip in name for chip in ("H100", "H200")):
        checks.check(f"bf16 matmul TFLOP/s ({name})", tflops, ">=", 500.0)
    else:
        checks.skip("bf16 matmul TFLOP/s", f"no reference rate for {name}")
    figures = {"gpu": name, "matmul_tflops": tflops, "big_moe": _big_moe(mode, checks)}
    if cuda():
        checks.check("big MoE step MFU vs the measured matmul rate", figures["big_moe"]["tflops"] / tflops, ">=", 0.02)
    else:
        checks.skip("big MoE step MFU vs the measured matmul rate", "rates mean nothing off a GPU")
    return figures


def _big_moe(mode: str, checks: Checks) -> dict:
    from moe_rl.models.tiny import tiny_config

    dims = (64, 2, 8, 2, 32, 512, 128, 2, 4, 2) if mode == "smoke" else (1024, 8, 64, 8, 384, 32768, 2048, 4, 16, 4)
    h, layers, experts, k, ffn, vocab, seq, batch, heads, kv = dims
    hf_config = tiny_config(
        "qwen3_moe", vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=h // heads, num_experts=experts, num_experts_per_tok=k,
        moe_intermediate_size=ffn, intermediate_size=4 * ffn, max_position_embeddings=seq,
    )  # fmt: skip
    import torch

    with one_rank(hf_config) as layout:
        model, ddp, optimizer, _ = _model(hf_config, layout, torch.bfloat16 if cuda() else torch.float32, lr=1e-5)
        batches = _fixed_batches(vocab, count=batch // 2, seq=seq)
        _nll_step(ddp, optimizer, batches)
        peak_mb(reset=True)
        losses = []
        seconds = timed(lambda: losses.append(_nll_step(ddp, optimizer, batches)), reps=3, warmup=0)
        total = sum(p.numel() for p in model.parameters())
    checks.check("big MoE step losses finite", all(map(math.isfinite, losses)), "==", True)
    tokens = batch * seq
    flops = moe_step_flops(hf_config, tokens=tokens, seq=seq)
    return {
        "total_params": total,
        "active_params": flops["active"],
        "tokens": tokens,
        "step_s": seconds,
        "tflops": flops["flops"] / seconds / 1e12,
        "peak_mb": peak_mb(),
    }
