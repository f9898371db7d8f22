"""What every ``tools/gpu_check/check.py`` stage shares: its checks (each a value against a stated
threshold, ok / FAILED / SKIPPED), the device, timing and memory helpers, and the run modes."""

from __future__ import annotations

import math
import operator
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OK, FAILED, SKIPPED = "ok", "FAILED", "SKIPPED"
OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
MODES = ("smoke", "quick", "full")  # smoke: any machine, tiny sizes
# the built-in model's warm-start cache, shared by the stages that train it (keyed by its config)
CACHE = Path(tempfile.gettempdir()) / "gpu_check_cache"  # smoke: tiny sizes, any machine (the numbers mean nothing)


@dataclass
class Checks:
    """One stage's assertions, in the order made."""

    items: list[dict] = field(default_factory=list)
    echo: bool = True  # print each check as it is made (a stage killed at its limit still shows how far it got)

    def check(self, name: str, value, op: str, threshold, note: str = "") -> bool:
        """``value op threshold`` holds (a NaN never does); recorded with both numbers."""
        passed = _finite(value) and bool(OPS[op](value, threshold))
        item = {"name": name, "verdict": OK if passed else FAILED, "value": _plain(value), "op": op}
        self._add(item | {"threshold": _plain(threshold)} | ({"note": note} if note else {}))
        return passed

    def skip(self, name: str, why: str) -> None:
        self._add({"name": name, "verdict": SKIPPED, "why": why})

    def fail(self, name: str, why: str) -> None:
        self._add({"name": name, "verdict": FAILED, "why": why})

    def _add(self, item: dict) -> None:
        self.items.append(item)
        if self.echo:
            print(check_line(item), flush=True)

    def verdict(self) -> str:
        """FAILED if any check failed (or none was made), SKIPPED if every one was skipped."""
        verdicts = {item["verdict"] for item in self.items}
        if FAILED in verdicts or not verdicts:
            return FAILED
        return SKIPPED if verdicts == {SKIPPED} else OK


def check_line(item: dict) -> str:
    said = f"{item['value']} {item['op']} {item['threshold']}" if "op" in item else item.get("why", "")
    return f"    {item['verdict']:7s} {item['name']}: {said}"


def _finite(value) -> bool:
    return not (isinstance(value, float) and math.isnan(value))


def _plain(value):
    return round(value, 8) if isinstance(value, float) and math.isfinite(value) else value


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device():
    import torch

    return torch.device("cuda") if cuda() else torch.device("cpu")


def sync() -> None:
    import torch

    if cuda():
        torch.cuda.synchronize()


def peak_mb(reset: bool = False) -> float:
    import torch

    if not cuda():
        return 0.0
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated() / 2**20


def timed(fn, reps: int = 5, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` over ``reps`` calls after ``warmup`` ones (device synced)."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def matmul_tflops(n: int) -> float:
    """The bf16 (CPU: fp32) rate of an ``n``-cube matmul on this device, TFLOP/s."""
    import torch

    dtype = torch.bfloat16 if cuda() else torch.float32
    a, b = (torch.randn(n, n, device=device(), dtype=dtype) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b, reps=10, warmup=3) / 1e12


def moe_step_flops(hf_config, tokens: int, seq: int) -> dict:
    """Model FLOPs of a forward + backward over ``tokens`` tokens in sequences of ``seq``
    (6 x active parameters per token, the output layer included, the input embedding (a
    lookup) not, plus causal attention's scores and values) for a Qwen3-MoE-shaped config;
    and its active parameters per token."""
    h, layers, heads, kv = (
        hf_config.hidden_size,
        hf_config.num_hidden_layers,
        hf_config.num_attention_heads,
        hf_config.num_key_value_heads,
    )
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    experts, k, ffn = hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size
    attention = h * head_dim * (heads + 2 * kv) + heads * head_dim * h
    active = layers * (attention + h * experts + k * 3 * h * ffn) + hf_config.vocab_size * h
    flops = 6 * active * tokens + 12 * layers * heads * head_dim * seq * tokens / 2
    return {"active": active, "flops": flops}


def rel_err(got, want) -> float:
    """``max |got - want| / max |want|`` in fp64 (0 where both are all zero)."""
    got, want = got.double(), want.double()
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


# a world of one this process started (--in-process): a child starts its own
_WORLD_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def cli_env() -> dict:
    return {
        **{k: v for k, v in os.environ.items() if k not in _WORLD_VARIABLES},
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


# when the running stage's time is up (``time.monotonic()``; set by gpu_check.py's stage process)
DEADLINE: list[float] = []


def moe_rl(*args: str, log: Path, timeout: float) -> int:
    """``moe-rl ARGS`` in a process of its own, its output to ``log`` (a file, not a pipe: the
    tensor sync's shared-memory manager may outlive the command); its exit code. Stopped 5 s
    before the stage's own limit (the end of its log printed), so that the stage says why."""
    if DEADLINE:
        timeout = min(timeout, DEADLINE[0] - time.monotonic() - 5)
    print(f"    moe-rl {args[0]} (at most {timeout:.0f} s; log {log.name})", flush=True)
    with open(log, "w") as out:
        command = [sys.executable, "-W", "ignore", "-m", "moe_rl.cli", *args]
        try:
            code = subprocess.run(command, stdout=out, stderr=out, timeout=max(timeout, 1), env=cli_env(), cwd=ROOT)
        except subprocess.TimeoutExpired:
            print(f"    moe-rl {args[0]} ran out of time; its log ends:\n{tail(log, 3000)}", flush=True)
            raise
    if code.returncode != 0:
        print(f"    moe-rl {args[0]} exited {code.returncode}; its log ends:\n{tail(log, 3000)}", flush=True)
    return code.returncode


def tail(path: Path, chars: int = 1200) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def one_rank(hf_config):
    """A world of one (gloo + the CPU bridge on CPU, NCCL on CUDA) for ``hf_config``; a context
    manager that tears megatron's groups down after."""
    import contextlib

    from moe_rl.models.architectures import model_dims
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.layout import ParallelLayout

    @contextlib.contextmanager
    def world():
        init_distributed(ParallelLayout(), model_dims(hf_config), seed=0)
        try:
            yield ParallelLayout()
        finally:
            destroy_distributed()

    return world()
