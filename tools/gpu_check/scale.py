"""``tools/gpu_check/check.py``'s scale stages (``--scale``): a slice of Qwen3-30B-A3B at its real layer
shapes (hidden 2048, 32 query / 4 KV heads of 128, 128 experts x 768 ffn, top-8; 4 layers and a
32k vocabulary: ~2.6B parameters, ~0.29B active per token; random weights), bf16, one GPU.

- ``slice``: an 8K-token micro-batch step (2 micro-batches, then the optimizer): forward +
  backward TFLOP/s and MFU against the bf16 matmul rate measured in the same stage, the
  optimizer's time apart, for each token dispatcher at EP 1 (moe-rl's one-rank one, megatron's
  allgather and alltoall), and moe-rl's with its RMSNorm written out op by op (what torch's
  fused rms_norm saves); a ``torch.profiler`` summary of the default (GPU-busy share,
  device-to-host syncs per step, the top kernels);
- ``long_context``: one 32K-token sequence with R3 (the model's own recorded routing replayed)
  and full activation recompute: peak memory, time against the plain recomputed step, the
  replayed forward's log-probs against the model's own;
- ``sync``: the weight sync's bucket packing from the slice's CUDA weights (GB/s, projected to
  Qwen3-30B-A3B's 61 GB), each packed tensor equal to the HF export's;
- ``checkpoint``: a checkpoint of a one-layer slice (32 experts) saved reshardable and not: the
  host memory staged, the GPU transient and the static memory against ``moe-rl budget``;
- ``peer``: ``tools/bench/peer.py --side both`` on the device, TRL's GRPOTrainer beside moe-rl
  at 6 and 256 new tokens (TRL from ``wheels/peer`` where the machine lacks it).

``--mode smoke --scale`` runs them at tiny sizes on any machine (CUDA-only checks SKIPPED).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tools.gpu_check.common import Checks, cuda, device, matmul_tflops, moe_step_flops, one_rank, peak_mb, sync

SLICE = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=6144,
    num_hidden_layers=4,
    vocab_size=32768,
    max_position_embeddings=32768,
)
TINY_SLICE = dict(  # (its attention 4 x 32 = 128 wide on a 64 hidden, as the slice's 32 x 128 on 2048)
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=1024,
)
QWEN3_30B_BF16_BYTES = 61.1e9  # its weights as the sync sends them (tools/bench/weight_sync.py's plan)
DISPATCHERS = ("one_rank", "allgather", "alltoall")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def slice_config(mode: str, **changes):
    from moe_rl.models.tiny import tiny_config

    return tiny_config("qwen3_moe", **(TINY_SLICE if mode == "smoke" else SLICE) | changes)


def _dtype():
    import torch

    return torch.bfloat16 if cuda() else torch.float32


def _built(hf_config, layout, *, lr: float = 1e-5, settings=None, **overrides):
    """The model (random weights, bf16 on CUDA), DDP and megatron's optimizer, as the trainer builds them."""
    from moe_rl.models.builder import build_model, make_transformer_config
    from parallel.optim import OptimSettings, build_optimizer, wrap_ddp

    config = make_transformer_config(hf_config, layout, params_dtype=_dtype(), **overrides)
    model = build_model(hf_config, config)
    settings = settings or OptimSettings(lr=lr)
    ddp = wrap_ddp(model, config, settings)
    return model, ddp, build_optimizer([ddp], settings), settings


def _sequences(vocab: int, count: int, seq: int, seed: int = 0) -> list:
    """``count`` micro-batches of one ``seq``-token row each (random tokens)."""
    import torch

    from moe_rl.models.forward import MicroBatch

    gen = torch.Generator().manual_seed(seed)
    return [MicroBatch(torch.randint(0, vocab, (1, seq), generator=gen)) for _ in range(count)]


def _nll(tokens: int):
    def loss_fn(out, mb):
        loss = -out[..., 0].float().sum() / tokens
        return loss, {"loss": loss.detach()}

    return loss_fn


def moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def use_dispatcher(model, kind: str) -> None:
    """Every MoE layer of ``model`` on dispatcher ``kind`` (``DISPATCHERS``), built on its groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

    from moe_rl.models.token_dispatch import OneRankTokenDispatcher

    cls = {"one_rank": OneRankTokenDispatcher, "allgather": MoEAllGatherTokenDispatcher}.get(
        kind, MoEAlltoAllTokenDispatcher
    )
    for layer in moe_layers(model):
        old = layer.token_dispatcher
        groups = ProcessGroupCollection(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        layer.token_dispatcher = cls(layer.num_local_experts, layer.local_expert_indices, layer.config, groups)


@contextlib.contextmanager
def norms_written_out() -> Iterator[None]:
    """moe-rl's RMSNorm computed op by op (x32 * rsqrt(mean(x32^2) + eps)) instead of with
    torch's rms_norm (one fused kernel on CUDA), within the block: what the fusion saves."""
    import torch

    from moe_rl.models.layers import RMSNorm

    fused = RMSNorm.forward

    def written_out(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    RMSNorm.forward = written_out
    try:
        yield
    finally:
        RMSNorm.forward = fused


def timed_step(ddp, optimizer, batches, loss_fn) -> dict:
    """One optimizer step: seconds of the forward + backward, of the rest (gradient
    finalize, norm, finite check, Adam), and the loss."""
    import torch

    from moe_rl.models.forward import run_microbatches
    from parallel.optim import train_step

    marks: dict = {}

    def forward_backward():
        sync()
        marks["start"] = time.perf_counter()
        out = run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False)
        sync()
        marks["backward_done"] = time.perf_counter()
        return out

    result = train_step([ddp], optimizer, forward_backward)
    sync()
    end = time.perf_counter()
    loss = float(torch.stack([o["loss"] for o in result.outputs]).sum())
    return {
        "forward_backward_s": marks["backward_done"] - marks["start"],
        "optimizer_s": end - marks["backward_done"],
        "loss": loss,
    }


def forward_logprobs(ddp, batches, hooks=()):
    import torch

    from moe_rl.models.forward import run_microbatches

    with torch.no_grad():
        return torch.cat([r["logprobs"].float() for r in run_microbatches([ddp], batches, hooks=hooks)])


# ----------------------------------------------------------------------- slice


def stage_slice(mode: str, checks: Checks, work: Path) -> dict:
    """The slice's step per dispatcher, its MFU, and a profile of the default one."""
    smoke = mode == "smoke"
    hf_config = slice_config(mode)
    seq, micro_batches, steps = (128, 2, 2) if smoke else (8192, 2, 3)
    matmul = matmul_tflops(256 if smoke else 8192)
    tokens = seq * micro_batches
    flops = moe_step_flops(hf_config, tokens=tokens, seq=seq)
    figures: dict = {"matmul_tflops": matmul, "tokens_per_step": tokens, "model_tflop_per_step": flops["flops"] / 1e12}
    with one_rank(hf_config) as layout:
        model, ddp, optimizer, _ = _built(hf_config, layout)
        figures |= {"total_params": sum(p.numel() for p in model.parameters()), "active_params": flops["active"]}
        batches, loss_fn = _sequences(hf_config.vocab_size, micro_batches, seq), _nll(tokens)
        probe = batches[:1]
        logp = {}  # every dispatcher's forward on the same (initial) weights
        for kind in DISPATCHERS:
            use_dispatcher(model, kind)
            logp[kind] = forward_logprobs(ddp, probe)
        use_dispatcher(model, "allgather")
        logp["allgather_again"] = forward_logprobs(ddp, probe)

        def measured(name: str) -> None:
            timed_step(ddp, optimizer, batches, loss_fn)  # warm-up
            peak_mb(reset=True)
            runs = [timed_step(ddp, optimizer, batches, loss_fn) for _ in range(steps)]
            fb = statistics.median(r["forward_backward_s"] for r in runs)
            figures[name] = {
                "forward_backward_s": fb,
                "optimizer_s": statistics.median(r["optimizer_s"] for r in runs),
                "forward_backward_tflops": flops["flops"] / fb / 1e12,
                "mfu": flops["flops"] / fb / 1e12 / matmul,
                "losses": [r["loss"] for r in runs],
                "peak_mb": peak_mb(),
            }
            print(f"    slice {name}: {figures[name]}", flush=True)

        for kind in DISPATCHERS:
            use_dispatcher(model, kind)
            measured(kind)
        use_dispatcher(model, "one_rank")
        with norms_written_out():  # the RMSNorm before torch's fused rms_norm, for its share
            measured("one_rank_norms_written_out")
        profiles = {}
        for kind in ("allgather", "one_rank"):
            use_dispatcher(model, kind)
            profiles[kind] = profile_steps(lambda: timed_step(ddp, optimizer, batches, loss_fn), steps=2)
        figures["profile"] = profiles["one_rank"]
        figures["allgather_syncs_per_step"] = profiles["allgather"]["syncs_per_step"]
        layers = len(moe_layers(model))
    for kind in DISPATCHERS:
        checks.check(f"{kind}: step losses finite", all(map(math.isfinite, figures[kind]["losses"])), "==", True)
    run_to_run = float((logp["allgather"] - logp["allgather_again"]).abs().max())
    for kind in ("one_rank", "alltoall"):
        diff = float((logp[kind] - logp["allgather"]).abs().max())
        figures[f"{kind}_vs_allgather_max_logp_diff"] = diff
        checks.check(
            f"{kind} vs megatron allgather: max |logp diff| (nats)",
            diff,
            "<=",
            max(3 * run_to_run, 1e-5 if smoke else 2e-2),
            note=f"allgather run to run: {run_to_run:.3g}",
        )
    figures["allgather_run_to_run_max_logp_diff"] = run_to_run
    if cuda():
        checks.check(
            "device-to-host syncs per step: megatron allgather's less one_rank's (its per-layer ones)",
            figures["allgather_syncs_per_step"] - figures["profile"]["syncs_per_step"],
            ">=",
            layers * micro_batches,
        )
        checks.check(
            "one_rank: forward+backward MFU vs the measured matmul rate", figures["one_rank"]["mfu"], ">=", 0.10
        )
    else:
        checks.skip("device-to-host syncs per step", "the CUDA runtime's synchronize calls are counted on a GPU")
        checks.skip("one_rank: forward+backward MFU vs the measured matmul rate", "rates mean nothing off a GPU")
    return figures


def profile_steps(step, steps: int) -> dict:
    """``torch.profiler`` over ``steps`` calls of ``step``: the GPU-busy share of their wall
    time, the host's waits for the device per step (the CUDA runtime's synchronize calls:
    reads of device values, and copies from pageable host memory), and the top kernels by
    device time. (On a CPU only the op counts mean something.)"""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda() else [])
    step()  # warm
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in kernels)
    syncs = sum(e.count for e in events if e.key in SYNC_CALLS)
    gemm = sum(
        e.self_device_time_total for e in kernels if any(s in e.key.lower() for s in ("gemm", "cutlass", "nvjet"))
    )
    attention = sum(e.self_device_time_total for e in kernels if "flash" in e.key.lower() or "fmha" in e.key.lower())
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    return {
        "wall_ms_per_step": wall_us / steps / 1e3,
        "gpu_busy_share": busy_us / wall_us,
        "syncs_per_step": syncs / steps,
        "matmul_kernel_share": gemm / busy_us if busy_us else 0.0,
        "attention_kernel_share": attention / busy_us if busy_us else 0.0,
        "kernel_launches_per_step": sum(e.count for e in kernels) / steps,
        "top_kernels": [
            {
                "name": e.key[:90],
                "ms_per_step": e.self_device_time_total / steps / 1e3,
                "calls_per_step": e.count / steps,
            }
            for e in top
        ],
    }


# ----------------------------------------------------------------------- long context


def stage_long_context(mode: str, checks: Checks, work: Path) -> dict:
    """One long sequence with R3 (the model's own routing, recorded in a forward pass, replayed)
    and full activation recompute; the plain recomputed step beside it (both after a warm step)."""
    import torch

    from moe_rl.models.forward import run_microbatches
    from moe_rl.routing.replay import RoutingReplay, replay_config_overrides
    from moe_rl.trainer.policy import FULL_RECOMPUTE
    from parallel.optim import train_step

    seq = 512 if mode == "smoke" else 32768
    hf_config = slice_config(mode, max_position_embeddings=seq)
    batch = _sequences(hf_config.vocab_size, 1, seq)
    loss_fn = _nll(seq)
    with one_rank(hf_config) as layout:
        overrides = replay_config_overrides("r3") | FULL_RECOMPUTE
        model, ddp, optimizer, _ = _built(hf_config, layout, **overrides)
        replay = RoutingReplay(model, recompute=True)

        def plain_step():
            return train_step(
                [ddp], optimizer, lambda: run_microbatches([ddp], batch, loss_fn=loss_fn, forward_only=False)
            )

        plain_step()  # warm: the optimizer's state and the kernels' first calls stay out of the timed steps
        own = forward_logprobs(ddp, batch)
        replay.start_record()
        recorded_logp = forward_logprobs(ddp, batch, hooks=[replay])
        routing = replay.recorded()
        routing_bytes = sum(t.numel() * t.element_size() for layers in routing for t in layers)

        def replayed_step():
            replay.start_replay(routing)
            out = train_step(
                [ddp],
                optimizer,
                lambda: run_microbatches([ddp], batch, loss_fn=loss_fn, hooks=[replay], forward_only=False),
            )
            replay.finish()  # every recompute entry consumed by the backward
            return out

        peak_mb(reset=True)
        sync()
        start = time.perf_counter()
        first = replayed_step()
        sync()
        replay_s = time.perf_counter() - start
        replay_peak = peak_mb()
        replayed = first.outputs[0]["logprobs"].float()
        sync()
        start = time.perf_counter()
        plain = plain_step()
        sync()
        plain_s = time.perf_counter() - start
        total = torch.cuda.get_device_properties(0).total_memory / 2**20 if cuda() else 0.0
    run_to_run = float((recorded_logp - own).abs().max())
    diff = float((replayed - own).abs().max())
    checks.check(
        "R3 + recompute at long context: step losses finite",
        all(math.isfinite(float(o["loss"])) for o in first.outputs + plain.outputs),
        "==",
        True,
    )
    checks.check(
        "replayed forward vs the model's own: max |logp diff| (same routing)",
        diff,
        "<=",
        max(3 * run_to_run, 1e-5 if mode == "smoke" else 2e-2),
        note=f"the model's own forward run to run: {run_to_run:.3g}",
    )
    if cuda():
        checks.check("R3 + recompute peak memory / the GPU's", replay_peak / total, "<=", 0.9)
    return {
        "tokens": seq,
        "replayed_step_s": replay_s,
        "plain_recomputed_step_s": plain_s,
        "replayed_vs_plain_time": replay_s / plain_s,
        "peak_mb": replay_peak,
        "routing_bytes": routing_bytes,
        "max_logp_diff_replayed_vs_own": diff,
        "own_run_to_run_max_logp_diff": run_to_run,
    }


# ----------------------------------------------------------------------- weight sync


def stage_sync(mode: str, checks: Checks, work: Path) -> dict:
    """The weight sync's buckets packed from the slice's weights on this device: GB/s, each
    packed HF tensor equal to ``gather_hf_tensors``'s export of the same weights."""
    import torch

    from moe_rl.models.hf_weights import gather_hf_tensors
    from moe_rl.models.weight_buckets import WeightStreamer

    hf_config = slice_config(mode)
    bucket_bytes = 2**20 if mode == "smoke" else 512 * 2**20
    with one_rank(hf_config) as layout:
        model, _, _, _ = _built(hf_config, layout)
        streamer = WeightStreamer(model, hf_config)
        total = streamer.total_bytes(torch.bfloat16)
        reference = gather_hf_tensors(model, hf_config, dtype=torch.bfloat16)
        unequal: list[str] = []
        seen = 0

        def compare(bucket, flat):
            nonlocal seen
            for name, tensor in bucket.unpack(flat):
                seen += 1
                if not torch.equal(tensor, reference[name]):
                    unequal.append(name)

        streamer.stream(bucket_bytes, torch.bfloat16, compare)
        reference.clear()  # (5 GB at full size: gone before the timed packing)
        seconds = []
        for _ in range(3):
            sync()
            start = time.perf_counter()
            buckets = streamer.stream(bucket_bytes, torch.bfloat16, None)
            sync()
            seconds.append(time.perf_counter() - start)
    packed = min(seconds)
    checks.check("packed HF tensors unequal to the export", len(unequal), "==", 0, note=", ".join(unequal[:3]))
    checks.check("packed HF tensors compared", seen, ">", 0)
    rate = total / packed / 1e9
    return {
        "bytes": total,
        "buckets": len(buckets),
        "bucket_mb": bucket_bytes / 2**20,
        "pack_s": packed,
        "pack_gb_per_s": rate,
        "qwen3_30b_a3b_projected_pack_s": QWEN3_30B_BF16_BYTES / 1e9 / rate,
        "device": str(device()),
    }


# ----------------------------------------------------------------------- checkpoint memory


def stage_checkpoint(mode: str, checks: Checks, work: Path) -> dict:
    """A one-layer slice (32 experts) with the distributed optimizer on one rank, so that the
    reshardable save's gather runs: a checkpoint saved ``fully_reshardable`` and
    ``dp_reshardable``; the host memory each staged (this process's peak resident set over
    the save), its GPU transient and the static GPU memory, against ``moe-rl budget``."""
    import torch

    from moe_rl.models.memory_budget import Layout, count_params, layer_params, save_budget, stage_budget
    from moe_rl.checkpoint.store import Checkpointer, TrainingState
    from parallel.optim import OptimSettings

    hf_config = slice_config(mode, num_hidden_layers=1, num_experts=8 if mode == "smoke" else 32)
    hf_dir = work / "hf"
    hf_config.save_pretrained(hf_dir)
    config_dict = hf_config.to_dict()
    counts, layers = count_params(config_dict), layer_params(config_dict)
    planned = Layout(world=1, distributed_optimizer=True)
    static_planned = stage_budget(counts, planned, 0, layers)
    figures: dict = {"params": counts.embedding + counts.output + counts.layers_dense + counts.layers_expert}
    for reshardable in (True, False):
        key = "fully_reshardable" if reshardable else "dp_reshardable"
        base = torch.cuda.memory_allocated() if cuda() else 0
        with one_rank(hf_config) as layout:
            settings = OptimSettings(lr=1e-5, use_distributed_optimizer=True)
            model, ddp, optimizer, _ = _built(hf_config, layout, settings=settings)
            timed_step(ddp, optimizer, _sequences(hf_config.vocab_size, 1, 64), _nll(64))
            static = (torch.cuda.memory_allocated() - base) / 1e9 if cuda() else float("nan")
            saver = Checkpointer(
                work / key, 1, layout, (hf_config, str(hf_dir)), async_save=False, reshardable=reshardable
            )
            before_gpu = torch.cuda.memory_allocated() if cuda() else 0
            peak_mb(reset=True)
            with ResidentPeak() as host:
                start = time.perf_counter()
                saver.save(1, TrainingState(model, optimizer, settings), {})
                saver.wait()
                seconds = time.perf_counter() - start
            transient = (peak_mb() * 2**20 - before_gpu) / 1e9 if cuda() else float("nan")
            del model, ddp, optimizer, saver
        predicted = save_budget(counts, planned, 0, layers, reshardable=reshardable)
        figures[key] = {
            "save_s": seconds,
            "host_peak_gb": host.peak_gb,
            "predicted_host_peak_gb": predicted["host_peak_GB"],
            "gpu_transient_gb": transient,
            "predicted_gpu_transient_gb": predicted["gpu_transient_GB"],
            "static_gpu_gb": static,
            "predicted_static_gpu_gb": static_planned["total_GB"],
        }
        print(f"    checkpoint {key}: {figures[key]}", flush=True)
        if mode != "smoke":  # (tiny sizes: the interpreter's own allocations dominate)
            # megatron stages to pinned host memory through torch's caching host allocator, which
            # rounds each block up to a power of two (up to 2x) and keeps the blocks: the second
            # save reuses the first's, so only the first can show the lower bound
            ratio = host.peak_gb / predicted["host_peak_GB"]
            checks.check(f"{key}: host peak / predicted", ratio, "<=", 2.0)
            if reshardable:
                checks.check(f"{key}: host peak / predicted (at least)", ratio, ">=", 0.5)
        if cuda():
            checks.check(f"{key}: static GPU memory / predicted", static / static_planned["total_GB"], "<=", 1.1)
            checks.check(
                f"{key}: GPU transient (GB) <= predicted + 0.5", transient, "<=", predicted["gpu_transient_GB"] + 0.5
            )
    checks.check("checkpoints written", sum(key in figures for key in ("fully_reshardable", "dp_reshardable")), "==", 2)
    return figures


class ResidentPeak:
    """This process's peak resident memory above where it started, sampled every 5 ms."""

    def __enter__(self) -> "ResidentPeak":
        self.start = self.peak = _resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _resident_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _resident_bytes())

    @property
    def peak_gb(self) -> float:
        return (self.peak - self.start) / 1e9


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------- TRL side by side

PEER_WHEELS = "wheels/peer"  # TRL and what it needs that the H200 lacks (tools/gpu_check/wheels.sh --peer)
PEER_RUNS = {"full": ((6, 12), (256, 12)), "smoke": ((4, 8),)}  # (new tokens, steps a side)


def stage_peer(mode: str, checks: Checks, work: Path) -> dict:
    """``tools/bench/peer.py --side both`` on this device: TRL's GRPOTrainer and moe-rl on the
    same built-in model and batch (8 prompts x 4), taking turns, at 6 and 256 new tokens; the
    median paired turn ratio moe-rl / TRL (goal: at most 0.8, as on CPU; checked: not slower).
    Without TRL (not installed, no wheels): moe-rl's side alone, the comparison SKIPPED."""
    import json
    import subprocess
    import sys

    from tools.gpu_check.common import CACHE, ROOT, cli_env, moe_rl, tail
    from tools.gpu_check.training import TINY_RUN

    cache = [f"warm_start.cache_dir={CACHE}"]
    if not checks.check(
        "moe-rl prepare exit code", moe_rl("prepare", *TINY_RUN, *cache, log=work / "prepare.log", timeout=120), "==", 0
    ):
        return {"error": tail(work / "prepare.log")}
    from moe_rl.config import load_config
    from moe_rl.models.demo_model import demo_model_dir

    model = str(demo_model_dir(load_config(None, [*TINY_RUN, *cache]).demo_model()))
    env = cli_env() | _peer_path(work)
    have_trl = (
        subprocess.run(
            [sys.executable, "-c", "import trl, datasets, accelerate"], env=env, capture_output=True
        ).returncode
        == 0
    )
    figures: dict = {"trl": have_trl, "device": "cuda" if cuda() else "cpu"}
    for new_tokens, steps in PEER_RUNS["smoke" if mode == "smoke" else "full"]:
        side = ["--side", "both"] if have_trl else ["--side", "moe-rl"]
        command = [
            sys.executable,
            str(ROOT / "tools" / "bench/peer.py"),
            *side,
            "--model",
            model,
            "--steps",
            str(steps),
        ]
        command += ["--steps-per-turn", "3", "--new-tokens", str(new_tokens), "--device", figures["device"]]
        log = work / f"peer_{new_tokens}.log"
        with open(log, "w") as out:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=300
            ).returncode
        found = [line for line in log.read_text().splitlines() if line.startswith("BENCH_JSON ")]
        if not checks.check(f"bench_peer at {new_tokens} new tokens: exit code", code, "==", 0) or not found:
            figures[f"tokens_{new_tokens}"] = {"error": tail(log, 2000)}
            continue
        result = json.loads(found[-1].removeprefix("BENCH_JSON "))
        if have_trl:
            figures[f"tokens_{new_tokens}"] = {
                "median_turn_ratio_moe_rl_over_trl": result["median_turn_time_ratio"],
                "turn_ratios": result["turn_time_ratios"],
                **{
                    f"{s}_{k}": result[s].get(k)
                    for s in ("moe-rl", "trl")
                    for k in ("median_step_s", "peak_rss_mib", "peak_gpu_mib")
                },
                "response_tokens": {s: statistics.mean(result[s]["response_tokens"]) for s in ("moe-rl", "trl")},
            }
            ratio = result["median_turn_time_ratio"]
            if mode != "smoke":  # (tiny runs on a shared CPU: the ratio is noise)
                checks.check(f"{new_tokens} new tokens: moe-rl / TRL step time (goal 0.8)", ratio, "<=", 1.0)
        else:
            figures[f"tokens_{new_tokens}"] = {"moe-rl_median_step_s": result["median_step_s"]}
            checks.check(f"{new_tokens} new tokens: moe-rl step time finite", result["median_step_s"], ">", 0.0)
        print(f"    peer {new_tokens} new tokens: {figures[f'tokens_{new_tokens}']}", flush=True)
    if not have_trl:
        checks.skip("moe-rl / TRL step time", f"TRL does not import here (install it, or carry {PEER_WHEELS})")
    return figures


def _peer_path(work: Path) -> dict:
    """``PYTHONPATH`` with those of TRL's wheels (``PEER_WHEELS``, where carried) whose package
    this python lacks installed into a folder of their own (nothing preinstalled replaced or
    shadowed); ``{}`` when none is needed."""
    import importlib.util
    import os
    import subprocess
    import sys

    from tools.gpu_check.common import ROOT

    wheels = [
        w for w in sorted((ROOT / PEER_WHEELS).glob("*.whl")) if importlib.util.find_spec(w.name.split("-")[0]) is None
    ]
    if not wheels:
        return {}
    target = work / "peer_site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--target",
        str(target),
    ]
    subprocess.run([*pip, *map(str, wheels)], check=True, timeout=120)
    return {"PYTHONPATH": f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
