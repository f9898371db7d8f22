"""Weight sync, the previous way against the current one, side by side: broadcasts per sync,
bytes moved, seconds.

    .venv/bin/python -m tools.bench.weight_sync [--layers 4] [--bucket-mb 16] [--syncs 2] [--json FILE]
    .venv/bin/python -m tools.bench.weight_sync --memory 16,64,256   # rank 0's peak extra memory per bucket size

- previous: one broadcast per HF tensor, every bucket packed on (and sent from) the first rank;
- current: one flat broadcast per bucket (``load_format="flattened_bucket"``, SGLang >= 0.5.6),
  each pipeline stage's first rank sending its own stage's buckets.

Measured: a random Qwen3-MoE (hidden 256, 16 experts of 256, vocab 8k; ``--layers``) trained
on 2 processes with pp=2 (rank 1 holds the second stage) syncs in bf16 to the project's
SGLang-protocol stand-in (``tests/support/sglang_test_server.py``, which receives as SGLang 0.5.23
does, over gloo), through the trainer's own ``DistributedSync``. The broadcasts are counted
where they are sent; the stand-in's count of update requests and of flat ones is checked.
Seconds are CPU/gloo figures: they show the per-call overhead, not NCCL bandwidth.

Planned (no compute): Qwen3-30B-A3B (``configs/examples/qwen3_30b_a3b.config.json``) on the
2x8 example's pp=2, 512 MiB buckets: its HF tensors (what the previous way broadcast one by
one; the list is the one the measured model's real plan is checked against) cut by the
trainer's own planner.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[2]

MODES = {"previous": {"flattened": False, "per_stage": False}, "current": {"flattened": None, "per_stage": True}}
SIZE = dict(
    hidden_size=256,
    moe_intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=2,
    vocab_size=8000,
)


def qwen3_moe_hf_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], int]]:
    """(HF checkpoint name, shape, pipeline stage of 2) of every tensor a Qwen3-MoE sync sends."""
    hidden, layers, experts = (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg.get("num_experts") or cfg["num_local_experts"],
    )
    heads, kv, head = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg.get("head_dim") or hidden // cfg["num_attention_heads"],
    )
    inter = cfg["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], hidden), 0)]
    for i in range(layers):
        stage, p = int(i >= layers // 2), f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (heads * head, hidden), stage),
            (p + "self_attn.k_proj.weight", (kv * head, hidden), stage),
            (p + "self_attn.v_proj.weight", (kv * head, hidden), stage),
            (p + "self_attn.o_proj.weight", (hidden, heads * head), stage),
            (p + "self_attn.q_norm.weight", (head,), stage),
            (p + "self_attn.k_norm.weight", (head,), stage),
            (p + "input_layernorm.weight", (hidden,), stage),
            (p + "post_attention_layernorm.weight", (hidden,), stage),
            (p + "mlp.gate.weight", (experts, hidden), stage),
        ]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", (inter, hidden), stage),
                (q + "up_proj.weight", (inter, hidden), stage),
                (q + "down_proj.weight", (hidden, inter), stage),
            ]
    out += [("model.norm.weight", (hidden,), 1)]
    if not cfg.get("tie_word_embeddings", False):
        out += [("lm_head.weight", (cfg["vocab_size"], hidden), 1)]
    return out


def planned_figures(cfg: dict, bucket_mb: float, senders: tuple[int, int] = (0, 8)) -> dict:
    """Broadcasts and bytes of one sync of ``cfg``'s model in bf16 on pp=2, from the trainer's
    planner (stage 1's first rank is ``senders[1]``)."""
    import torch

    from moe_rl.models.weight_buckets import WeightEntry, plan_buckets

    entries = [
        WeightEntry(senders[stage], name, ((name, shape),), torch.float32, stage)
        for name, shape, stage in qwen3_moe_hf_tensors(cfg)
    ]
    out = {}
    for mode, how in MODES.items():
        plan = plan_buckets(
            entries, int(bucket_mb * 2**20), torch.bfloat16, list(senders) if how["per_stage"] else [0, 0]
        )
        out[mode] = _plan_figures(plan, len(entries), flattened=how["flattened"] is not False)
    return out


def _plan_figures(plan: list, tensors: int, *, flattened: bool) -> dict:
    """Per sync: broadcasts, bytes each server rank receives, bytes another stage sends the
    first rank, bytes the first rank broadcasts."""
    first = [b for b in plan if b.sender == 0]
    return {
        "broadcasts": len(plan) if flattened else tensors,
        "update_requests": len(plan),
        "gb_broadcast": sum(b.nbytes for b in plan) / 1e9,
        "gb_to_first_rank_from_other_stages": sum(b.nbytes for b in first if b.stage > 0) / 1e9,
        "gb_first_rank_broadcasts": sum(b.nbytes for b in first) / 1e9,
    }


class PeakSampler:
    """Peak memory above the level at start: CUDA allocated bytes, or RSS sampled in a thread."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.peak = self.start = 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "PeakSampler":
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.start = self.peak = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def memory_worker(hf_dir: str, bucket_mb: float, out: str) -> None:
    """Rank 0's extra peak while it receives the whole model in buckets of ``bucket_mb`` (0: one)."""
    import torch

    from moe_rl.models.architectures import load_hf_config, model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.weight_buckets import HFWeights
    from parallel.collectives import barrier, rank
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.layout import ParallelLayout

    hf_config = load_hf_config(hf_dir)
    layout = ParallelLayout(ep=2)
    init_distributed(layout, model_dims(hf_config))
    model = build_model(hf_config, make_transformer_config(hf_config, layout))  # random weights: only sizes matter
    weights = HFWeights(model, hf_config)
    _ = weights.streamer  # the plan, made once per run (not part of a sync)
    barrier()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        held: list = []  # "whole": the one bucket is kept, as gather() keeps everything
        keep = held.append if bucket_mb <= 0 else None
        buckets = weights.send_buckets(int(bucket_mb * 2**20) if bucket_mb > 0 else sys.maxsize, torch.bfloat16, keep)
    seconds = time.perf_counter() - start
    if rank() == 0:
        total = weights.streamer.total_bytes(torch.bfloat16) / 2**20
        result = {
            "bucket_mb": bucket_mb or "whole",
            "buckets": buckets,
            "extra_mb": round(sampler.extra_mb, 1),
            "model_mb_bf16": round(total, 1),
            "seconds": round(seconds, 2),
        }
        Path(out).write_text(json.dumps(result))
    destroy_distributed()


def worker(hf_dir: str, url: str, bucket_mb: float, syncs: int, out: str) -> None:
    import torch

    from moe_rl.models.architectures import load_hf_config, model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.weight_buckets import HFWeights
    from moe_rl.rollout.sglang.engine import SGLangEngine
    from moe_rl.rollout.weight_sync.distributed import DistributedSync
    from parallel.collectives import all_gather_objects, barrier, rank
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.layout import ParallelLayout

    hf_config = load_hf_config(hf_dir)
    layout = ParallelLayout(pp=2)
    init_distributed(layout, model_dims(hf_config))
    model = build_model(hf_config, make_transformer_config(hf_config, layout))  # random weights: only sizes matter
    weights = HFWeights(model, hf_config)
    bucket_bytes = int(bucket_mb * 2**20)
    planned = {(name, shape) for name, shape, _ in qwen3_moe_hf_tensors(hf_config.to_dict())}
    real = {(t.name, tuple(t.shape)) for b in weights.plan(bucket_bytes, torch.bfloat16) for t in b.tensors}
    assert planned == real, f"the planned tensor list differs from the trainer's: {sorted(planned ^ real)[:4]}"
    engine = SGLangEngine([url], weight_version="default") if rank() == 0 else None
    results = {}
    for mode, how in MODES.items():
        sync = DistributedSync(
            engine, bucket_bytes=bucket_bytes, dtype=torch.bfloat16, backend="gloo", timeout_s=300, **how
        )
        seconds = []
        for i in range(syncs + 1):  # the first also connects: not timed
            barrier()
            start = time.perf_counter()
            sync.push(weights, f"{mode}-{i}")
            barrier()
            seconds.append(time.perf_counter() - start)
        broadcasts = sum(all_gather_objects(sync.broadcasts)) // (syncs + 1)
        plan = weights.plan(bucket_bytes, torch.bfloat16, per_stage=how["per_stage"])
        results[mode] = {
            **_plan_figures(plan, len(real), flattened=sync.link.flattened),
            "measured_broadcasts": broadcasts,
            "seconds": statistics.median(seconds[1:]),
            "senders": len(sync.link.group_names),
            "groups": sorted(sync.link.group_names.values()),
        }
        sync.close()
    if rank() == 0:
        Path(out).write_text(json.dumps(results))
    destroy_distributed()


def measure(args: argparse.Namespace) -> dict:
    """One stand-in server, then the 2-process trainer syncing to it both ways; the stand-in's
    own counts of the update requests it got (and how many came flat)."""
    import httpx

    from moe_rl.models.tiny import save_tiny_checkpoint
    from moe_rl.rollout.sglang.server import ServerSettings, SGLangServer
    from parallel.launch import free_port, spawn_local

    tmp = Path(tempfile.mkdtemp())
    hf_dir = save_tiny_checkpoint(tmp / "hf", "qwen3_moe", seed=0, num_hidden_layers=args.layers, **SIZE)
    stand_in = [sys.executable, "-W", "ignore", str(ROOT / "tests" / "support" / "sglang_test_server.py")]
    # "cuda": no CPU flags
    settings = ServerSettings(model_path=hf_dir, port=free_port(), device="cuda", launch_command=stand_in)
    with SGLangServer(settings, tmp / "logs") as server:
        server.wait_healthy(timeout_s=300)
        out = tmp / "result.json"
        argv = [
            "-m",
            "tools.bench.weight_sync",
            "--worker",
            hf_dir,
            server.url,
            str(args.bucket_mb),
            str(args.syncs),
            str(out),
        ]
        code = spawn_local(2, argv, timeout_s=1800)
        if code != 0:
            raise SystemExit(f"the trainer processes failed with exit code {code}")
        requests = httpx.get(server.url + "/_test/stats", timeout=30).json()["update_requests"]
    results = json.loads(out.read_text())
    for r in results.values():  # a mode's requests came through its own groups
        groups = set(r.pop("groups"))
        got = [request for request in requests if request["group"] in groups]
        r["server_update_requests"] = len(got) // (args.syncs + 1)
        r["server_flat_requests"] = sum(request["flattened"] for request in got) // (args.syncs + 1)
    return results


def measure_memory(layers: int, buckets: str) -> list[dict]:
    """Rank 0's extra peak memory per bucket size (and for the whole model in one bucket, what
    the in-process sync holds): a random Qwen3-MoE (hidden 1024, 32 experts of 512, vocab 32k)
    on 2 processes with EP=2, so rank 1's experts travel to rank 0 point to point; one fresh
    pair of processes per size (CUDA: allocated bytes; CPU: resident set sampled every 2 ms)."""
    from moe_rl.models.tiny import tiny_config
    from parallel.launch import spawn_local

    tmp = Path(tempfile.mkdtemp())
    size = dict(
        hidden_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        vocab_size=32000,
    )
    hf_dir = str(tmp / "hf")
    tiny_config("qwen3_moe", **size).save_pretrained(hf_dir)  # the config is all the workers need
    rows = []
    for bucket_mb in [float(b) for b in buckets.split(",")] + [0.0]:
        out = tmp / f"r{bucket_mb}.json"
        # glibc returns large frees to the OS at once (else its moving mmap threshold keeps them in RSS)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
        code = spawn_local(
            2,
            ["-m", "tools.bench.weight_sync", "--memory-worker", hf_dir, str(bucket_mb), str(out)],
            timeout_s=900,
            env=env,
        )
        if code != 0:
            raise SystemExit(f"worker for bucket {bucket_mb} MiB failed with exit code {code}")
        rows.append(json.loads(out.read_text()))
        r = rows[-1]
        print(
            f"bucket {str(r['bucket_mb']):>6} MiB: {r['buckets']:3d} bucket(s), rank 0 extra peak {r['extra_mb']:8.1f} MiB "
            f"of a {r['model_mb_bf16']:.0f} MiB model (bf16), {r['seconds']:.2f} s",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size of the measured model (MiB)")
    parser.add_argument("--syncs", type=int, default=2, help="timed syncs per mode (after one that connects)")
    parser.add_argument("--json")
    parser.add_argument(
        "--memory", metavar="MIB,MIB", help="instead: rank 0's peak extra memory for these bucket sizes (EP=2)"
    )
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        hf_dir, url, bucket_mb, syncs, out = args.worker
        worker(hf_dir, url, float(bucket_mb), int(syncs), out)
        return
    if args.memory_worker:
        memory_worker(args.memory_worker[0], float(args.memory_worker[1]), args.memory_worker[2])
        return
    if args.memory:
        rows = measure_memory(args.layers, args.memory)
        print("BENCH_JSON " + json.dumps({"memory": rows}, sort_keys=True))
        return
    measured = measure(args)
    config = json.loads((ROOT / "configs" / "examples" / "qwen3_30b_a3b.config.json").read_text())
    planned = planned_figures(config, 512.0)
    _print_rows(
        f"measured: random Qwen3-MoE, {args.layers} layers, pp=2, {args.bucket_mb:g} MiB buckets, bf16, 1 stand-in server",
        measured,
    )
    _print_rows("planned: Qwen3-30B-A3B, pp=2 (stage 1's first rank is rank 8), 512 MiB buckets, bf16", planned)
    summary = {"measured": measured, "qwen3_30b_a3b_planned": planned}
    print("BENCH_JSON " + json.dumps(summary, sort_keys=True))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


def _print_rows(title: str, rows: dict) -> None:
    print(title)
    print(
        f"  {'':9} {'broadcasts':>10} {'requests':>8} {'GB/server rank':>14} {'GB to rank 0 from stage 1':>25} {'GB rank 0 sends':>15} {'s/sync':>7}"
    )
    for mode, r in rows.items():
        seconds = f"{r['seconds']:7.2f}" if "seconds" in r else f"{'-':>7}"
        print(
            f"  {mode:9} {r.get('measured_broadcasts', r['broadcasts']):>10} {r['update_requests']:>8} {r['gb_broadcast']:>14.4f} "
            f"{r['gb_to_first_rank_from_other_stages']:>25.4f} {r['gb_first_rank_broadcasts']:>15.4f} {seconds}"
        )


if __name__ == "__main__":
    main()
