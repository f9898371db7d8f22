"""moe-rl benchmarks, every figure measured side by side in one run on this machine.

    .venv/bin/python -m tools.bench.run [--quick] [--json bench.json] [--report docs/benchmarks/DATE-MACHINE.md]

Sections: the machine's fp32 matmul peak; an RL training step of a small MoE under
megatron-core (tokens/s, MFU against that peak) and of a 188M-parameter one; routing-replay
and drift-metric overhead and the routing the drift metrics keep per number of micro-batches;
the KL reference's device memory and pass time (second model vs host swap); an 8k-token
response's routing (rank-0 decode time, bytes kept per token); the time a checkpoint save
blocks training; broadcasts per weight sync; padding of fixed vs token-budget micro-batches; log-prob memory/time (chunked vs full-vocabulary logits, vocab 151,936);
local-engine throughput and the SGLang client's overhead per request; TRL's
GRPOTrainer vs moe-rl on one GRPO step of the same tiny Qwen3-MoE (the ratio: the median of
paired turns' ratios) and where moe-rl's step time goes, stage by stage
(``tools/bench/stages.py``); the policy losses;
and a GPU section when a GPU is present. ``--quick`` keeps it under 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import warnings

warnings.filterwarnings("ignore", category=UserWarning)

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def sub_json(args: list[str], timeout: int = 1200) -> dict:
    """Run a tool script; return the JSON it printed after BENCH_JSON."""
    out = subprocess.run(
        [PY, "-W", "ignore", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    m = re.search(r"^BENCH_JSON (.*)$", out.stdout, re.M)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"{args[0]} failed ({out.returncode}): {out.stderr[-1500:]}")
    return json.loads(m.group(1))


def matmul_peak(n: int, repeats: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best / 1e9


def client_overhead(requests: int) -> dict:
    """The SGLang client's own cost per /generate against a server that answers at once."""
    from moe_rl.rollout.sglang.engine import SGLangEngine
    from moe_rl.rollout.types import SamplingParams
    from parallel.launch import free_port

    body = json.dumps(
        {
            "output_ids": [5, 6],
            "meta_info": {
                "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
                "finish_reason": {"type": "length", "length": 2},
                "weight_version": "0",
            },
        }
    ).encode()

    class Canned(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = 1 << 16  # one write per reply: header and body in separate packets hit delayed ACKs (~40 ms)

        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = {}
    try:
        for concurrency in (1,):  # the server shares this process: concurrency would measure its threads
            engine = SGLangEngine([f"http://127.0.0.1:{port}"], max_concurrency=concurrency, weight_version="0")
            engine.generate([[1, 2, 3]], 4, SamplingParams(max_new_tokens=2), seed=0)
            start = time.perf_counter()
            engine.generate([[1, 2, 3]] * (requests // 8), 8, SamplingParams(max_new_tokens=2), seed=1)
            out[f"ms_per_request_concurrency_{concurrency}"] = (time.perf_counter() - start) / requests * 1e3
    finally:
        server.shutdown()
    return out


def padding_fractions(samples: int = 256, ranks: int = 4, micro_batch_size: int = 8, max_tokens: int = 4096) -> dict:
    """Padding share of one step's micro-batches, computed from the plans. Spread 10-500
    tokens: fixed rows padded to the step's longest vs packed under ``max_tokens``.
    Long-tailed (DAPO-like: prompts ~150 tokens, lognormal responses of median ~1,500 cut at
    8,192): the old default (fixed rows padded to the step's longest), rows padded each to
    their own longest (``max_tokens_per_micro_batch=0``) and the default derived budget."""
    import random

    from moe_rl.trainer.packing import derived_budget, fixed_plan, round_up, token_budget_plan

    def padding(lengths, plans, own_longest: bool) -> tuple[float, int]:
        """(padding share, the largest micro-batch's padded tokens)."""
        width = lambda mb: (
            round_up(max([lengths[i] for i in mb if i is not None] or [2]), 8)
            if own_longest
            else round_up(max(lengths), 8)
        )  # noqa: E731
        sizes = [len(mb) * width(mb) for plan in plans for mb in plan]
        return 1 - sum(lengths) / sum(sizes), max(sizes)

    def by_rows(lengths) -> list:
        return [
            fixed_plan(range(r, len(lengths), ranks), -(-len(lengths) // ranks), micro_batch_size) for r in range(ranks)
        ]

    spread = [10 + (i * 7919) % 491 for i in range(samples)]
    packed = [token_budget_plan(spread, r, ranks, max_tokens, 64, 8) for r in range(ranks)]
    gen = random.Random(0)
    tail = [
        min(512, max(32, int(gen.lognormvariate(5.0, 0.5)))) + min(8192, max(1, int(gen.lognormvariate(7.3, 0.9))))
        for _ in range(samples)
    ]
    budget = derived_budget(tail, micro_batch_size, 8)
    derived = [token_budget_plan(tail, r, ranks, budget, micro_batch_size, 8) for r in range(ranks)]
    long_tailed = {"mean_tokens": sum(tail) / samples, "longest": max(tail), "derived_budget": budget}
    for name, plans, own in (
        ("old_default", by_rows(tail), False),
        ("rows", by_rows(tail), True),
        ("default", derived, True),
    ):
        frac, largest = padding(tail, plans, own)
        long_tailed[name] = {
            "padding_frac": frac,
            "micro_batches": len(plans[0]),
            "largest_micro_batch_tokens": largest,
        }
    return {
        "samples": samples,
        "ranks": ranks,
        "fixed": padding(spread, by_rows(spread), False)[0],
        "packed": padding(spread, packed, True)[0],
        "fixed_micro_batches": len(by_rows(spread)[0]),
        "packed_micro_batches": len(packed[0]),
        "max_tokens": max_tokens,
        "micro_batch_size": micro_batch_size,
        "long_tailed": long_tailed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--report", help="also write the dated Markdown report here (tools/bench/report.py)")
    args = p.parse_args()
    q = args.quick
    results: dict = {"threads": torch.get_num_threads(), "quick": q}
    t0 = time.perf_counter()

    print("== machine: fp32 matmul peak", flush=True)
    peak = matmul_peak(1024 if q else 2048, 3 if q else 5)
    results["matmul_peak_gflops"] = peak

    print("== RL training step under megatron-core; replay and drift overhead", flush=True)
    routing_json = tempfile.mktemp(suffix=".json")
    subprocess.run(
        [PY, "-W", "ignore", "-m", "tools.bench.routing", "--repeats", "3" if q else "5", "--json", routing_json],
        check=True,
        capture_output=True,
        timeout=1200,
    )
    routing = json.loads(Path(routing_json).read_text())
    plain_s = routing["variants"]["plain"]["ms"] / 1e3
    # one RL step = old-log-prob forward (2N) + update forward and backward (6N) per token
    flops = (
        8 * routing["active_params"] * routing["tokens"]
        + 4 * 3 * routing["layers"] * routing["seq_len"] * routing["attn_dim"] * routing["tokens"]
    )
    results["train_step"] = {
        "tokens": routing["tokens"],
        "seconds": plain_s,
        "tokens_per_s": routing["tokens"] / plain_s,
        "mfu": flops / plain_s / (peak * 1e9),
        "active_params": routing["active_params"],
    }
    results["routing_overhead"] = {k: v["ratio"] for k, v in routing["variants"].items()}
    results["probe_memory"] = routing["probe_memory"]
    results["routing_data"] = routing[
        "routing_data"
    ]  # an 8k-token Qwen3-30B-A3B response's routing: decode, bytes kept

    print("== RL step MFU on a 188M-parameter MoE (compute-bound), and where its time goes", flush=True)
    mfu_json = tempfile.mktemp(suffix=".json")
    subprocess.run(
        [
            PY,
            "-W",
            "ignore",
            "-m",
            "tools.bench.mfu",
            "--tokens",
            "1024" if q else "2048",
            "--repeats",
            "2" if q else "3",
            "--json",
            mfu_json,
        ],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    results["train_step_large"] = json.loads(Path(mfu_json).read_text())

    print("== KL reference: a second model on the device vs starting weights swapped in from host memory", flush=True)
    ref_json = tempfile.mktemp(suffix=".json")
    subprocess.run(
        [PY, "-W", "ignore", "-m", "tools.bench.reference", "--repeats", "2" if q else "3", "--json", ref_json],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    results["reference"] = json.loads(Path(ref_json).read_text())

    print("== checkpoints: training blocked by a save of the 188M model (format 1, sync, background)", flush=True)
    results["checkpoint"] = sub_json(["-m", "tools.bench.checkpoint", "--repeats", "2" if q else "3"])

    print(
        "== weight sync: broadcasts per sync (per tensor from one sender vs flat buckets from a sender per stage)",
        flush=True,
    )
    results["weight_sync"] = sub_json(["-m", "tools.bench.weight_sync", "--syncs", "1" if q else "2"])

    print("== padding: fixed micro-batches vs packed under a token budget", flush=True)
    results["padding"] = padding_fractions()

    print("== log-prob memory and time: chunked vs full-vocabulary logits", flush=True)
    seq = "1024" if q else "4096"
    lp = {v: sub_json(["-m", "tools.bench.logprob", "--variant", v, "--seq", seq]) for v in ("chunked", "naive")}
    results["logprob"] = {
        "vocab": 151936,
        "seq": int(seq),
        **{f"{v}_growth_mib": lp[v]["growth_mib"] for v in lp},
        **{f"{v}_seconds": lp[v]["seconds"] for v in lp},
        "memory_ratio_chunked_over_naive": lp["chunked"]["growth_mib"] / lp["naive"]["growth_mib"],
        "time_ratio_chunked_over_naive": lp["chunked"]["seconds"] / lp["naive"]["seconds"],
    }

    print("== rollout: local engine, SGLang client overhead", flush=True)
    out = subprocess.run(
        [PY, "-W", "ignore", "-m", "tools.bench.rollout", "--new-tokens", "32" if q else "64"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    m = re.search(r"= (\d+) tokens/s", out.stdout)
    results["rollout"] = {"local_tokens_per_s": float(m.group(1)) if m else None, **client_overhead(64 if q else 256)}

    print("== peer: TRL GRPOTrainer vs moe-rl, one GRPO step of the same tiny Qwen3-MoE", flush=True)
    try:
        import trl  # noqa: F401

        model_dir = _demo_model()
        rounds = [
            sub_json(
                [
                    "-m",
                    "tools.bench.peer",
                    "--side",
                    "both",
                    "--model",
                    model_dir,
                    "--steps",
                    "12" if q else "60",
                    "--steps-per-turn",
                    "3",
                    "--first",
                    first,
                ]
            )
            for first in ("moe-rl", "trl", "moe-rl")[: 1 if q else 3]
        ]
        step = {side: statistics.median(r[side]["median_step_s"] for r in rounds) for side in ("moe-rl", "trl")}
        rss = {side: max(r[side]["peak_rss_mib"] for r in rounds) for side in ("moe-rl", "trl")}
        # the two processes take turns of 3 steps (who starts alternates run by run): paired
        # turns ran within a second of each other, so their ratio cancels the machine's spells
        turn_ratios = [x for r in rounds for x in r["turn_time_ratios"]]
        results["peer"] = {
            "moe_rl_step_s": step["moe-rl"],
            "trl_step_s": step["trl"],
            "runs": len(rounds),
            "turns": len(turn_ratios),
            "time_ratio_moe_rl_over_trl": step["moe-rl"] / step["trl"],
            "run_time_ratios": [r["moe-rl"]["median_step_s"] / r["trl"]["median_step_s"] for r in rounds],
            "median_turn_time_ratio": statistics.median(turn_ratios),
            "response_tokens": {
                side: statistics.mean(x for r in rounds for x in r[side]["response_tokens"]) for side in step
            },
            "moe_rl_peak_rss_mib": rss["moe-rl"],
            "trl_peak_rss_mib": rss["trl"],
            "memory_ratio_moe_rl_over_trl": rss["moe-rl"] / rss["trl"],
        }
    except ImportError:
        results["peer"] = "skipped: TRL is not installed (.venv/bin/pip install trl)"

    print("== where one moe-rl step's time goes: its stages timed inside one training process", flush=True)
    results["stages"] = sub_json(["-m", "tools.bench.stages", "--model", _demo_model(), "--steps", "20" if q else "60"])

    print("== policy losses", flush=True)
    loss_json = tempfile.mktemp(suffix=".json")
    shape = ["--batch", "64", "--seq", "1024"] if q else []
    subprocess.run(
        [PY, "-m", "tools.bench.losses", *shape, "--json", loss_json], check=True, capture_output=True, timeout=600
    )
    results["losses"] = json.loads(Path(loss_json).read_text())

    results["gpu"] = (
        f"GPU present ({torch.cuda.get_device_name(0)}): not measured by this version"
        if torch.cuda.is_available()
        else "no GPU on this machine: the GPU section (throughput, MFU vs bf16 peak, memory) did not run"
    )
    results["wall_s"] = time.perf_counter() - t0
    Path(args.json).write_text(json.dumps(results, indent=2))
    _print_table(results)
    if args.report:
        from tools.bench.report import write_report

        write_report(results, Path(args.report))


def _demo_model() -> str:
    from moe_rl.config import load_config
    from moe_rl.models.demo_model import demo_model_dir

    path = demo_model_dir(load_config(None).demo_model())
    if not (path / "config.json").is_file():
        subprocess.run([PY, "-m", "moe_rl.cli", "prepare"], check=True, capture_output=True, timeout=900)
    return str(path)


def _large_row(m: dict) -> str:
    top = m["top_ops"]
    total = sum(op["self_cpu_ms"] for op in top)
    mm = sum(op["self_cpu_ms"] for op in top if op["op"] in ("aten::mm", "aten::bmm", "aten::baddbmm"))
    return (
        f"{m['tokens'] / m['step_s']:.0f} tokens/s, MFU {100 * m['mfu']:.1f}%; matmuls {100 * mm / total:.0f}% "
        f"of the top ops' time, the rest elementwise"
    )


def _reference_rows(ref: dict) -> list[tuple[str, str]]:
    mib, mem, sec = 2**20, ref["memory"], ref["seconds"]
    return [
        (
            f"KL reference, 188M MoE stage of {ref['stage_bytes'] / mib:.0f} MiB: device memory",
            f"reference=device {mem['device']['device_bytes'] / mib:.0f} MiB vs host {mem['host']['device_bytes'] / mib:.0f} MiB "
            f"(host keeps {mem['host']['host_bytes'] / mib:.0f} MiB in host memory: the snapshot and a swap buffer)",
        ),
        (
            f"  reference pass, {ref['tokens']} tokens",
            f"device {sec['device']:.2f}s, host {sec['host']:.2f}s; policy log-prob pass {sec['policy']:.2f}s",
        ),
    ]


def _probe_row(rows: list[dict]) -> str:
    return "; ".join(
        f"{r['micro_batches']} micro-batches: old pass {(r['old_device_bytes'] + r['old_host_bytes']) / 1024:.0f} KB, "
        f"later passes {r['new_kept_bytes'] / 1024:.0f} KB"
        for r in rows
    )


def _padding_rows(p: dict) -> list[tuple[str, str]]:
    """padding_fractions' rows: the spread lengths, and the long-tailed ones by default old and new."""
    tail, rows = p["long_tailed"], p["micro_batch_size"]
    cell = lambda k: (
        f"{100 * tail[k]['padding_frac']:.0f}% in {tail[k]['micro_batches']} micro-batches (largest {tail[k]['largest_micro_batch_tokens']:,} tokens)"
    )  # noqa: E731
    return [
        (
            f"padding, {p['samples']} samples of 10-500 tokens on {p['ranks']} ranks",
            f"fixed {p['fixed_micro_batches']} x {rows} rows {100 * p['fixed']:.0f}% vs packed "
            f"<= {p['max_tokens']} tokens ({p['packed_micro_batches']} micro-batches) {100 * p['packed']:.0f}%",
        ),
        (
            f"perf/padding_frac, {p['samples']} long-tailed samples (mean {tail['mean_tokens']:.0f}, longest {tail['longest']:,}) on {p['ranks']} ranks",
            f"old default (rows padded to the step's longest) {cell('old_default')} vs default (budget {tail['derived_budget']:,} = "
            f"{rows} x mean) {cell('default')}; rows padded each {100 * tail['rows']['padding_frac']:.0f}%",
        ),
    ]


def _routing_data_rows(d: dict) -> list[tuple[str, str]]:
    shape, ms, kept = d["shape"], d["decode_ms"], d["bytes_per_token"]
    sample, replay = (
        kept["sample: rank 0, and each rank's share (host)"],
        kept["R3 replay indices, kept for the step (device)"],
    )
    return [
        (
            f"routing of one {shape['tokens']}-token response ({shape['layers']} layers x top-{shape['top_k']} of {shape['experts']}): rank-0 decode",
            f"{ms['now']:.1f} ms vs {ms['before']:.1f} ms before (json.loads of the reply {ms['json.loads of the reply (unchanged, for scale)']:.1f} ms)",
        ),
        (
            "  bytes per token kept: sample / R3 replay indices",
            f"{sample[0]:.0f} / {replay[0]:.0f} vs {sample[1]:.0f} / {replay[1]:.0f} before",
        ),
    ]


def _checkpoint_rows(c: dict) -> list[tuple[str, str]]:
    sec, size = c["seconds"], c["bytes"]
    return [
        (
            f"checkpoint, {c['params'] / 1e6:.0f}M-parameter policy: training blocked by a save",
            f"background {sec['async blocked']:.2f}s = {100 * c['blocked_over_sync']:.0f}% of a synchronous save ({sec['sync']:.2f}s), "
            f"{100 * c['blocked_over_format1']:.0f}% of format 1's ({sec['format 1']:.2f}s); written after {sec['async written']:.2f}s",
        ),
        ("  size", f"{size['dist'] / 1e9:.2f} GB (format 1: {size['format 1'] / 1e9:.2f} GB)"),
    ]


def _weight_sync_rows(w: dict) -> list[tuple[str, str]]:
    m, p = w["measured"], w["qwen3_30b_a3b_planned"]
    return [
        (
            "weight sync, broadcasts per sync: measured (4-layer model, pp=2, stand-in server)",
            f"{m['current']['measured_broadcasts']} (flat buckets) vs {m['previous']['measured_broadcasts']} (per tensor)",
        ),
        (
            "  Qwen3-30B-A3B on pp=2, 512 MiB buckets (planned)",
            f"{p['current']['broadcasts']} vs {p['previous']['broadcasts']}; rank 0 sends {p['current']['gb_first_rank_broadcasts']:.1f} GB "
            f"vs {p['previous']['gb_first_rank_broadcasts']:.1f} GB",
        ),
    ]


def _print_table(r: dict) -> None:
    rows = table_rows(r)
    width = max(len(a) for a, _ in rows)
    print(f"\nmoe-rl benchmarks ({r['threads']} threads, {'quick' if r['quick'] else 'full'}, {r['wall_s']:.0f}s)")
    for a, b in rows:
        print(f"  {a:<{width}}  {b}")


def table_rows(r: dict) -> list[tuple[str, str]]:
    """The run's figures (``bench.json``) as (what, figure) rows: the console table, and the
    dated report ``tools/bench/report.py`` writes."""
    t, lp, ro = r["train_step"], r["logprob"], r["rollout"]
    rows = [
        ("fp32 matmul peak (this machine)", f"{r['matmul_peak_gflops']:.1f} GFLOP/s"),
        ("RL step, megatron-core, small MoE", f"{t['tokens_per_s']:.0f} tokens/s, MFU {100 * t['mfu']:.2f}%"),
        ("RL step, 188M-parameter MoE (59M active)", _large_row(r["train_step_large"])),
        *_reference_rows(r["reference"]),
        ("routing kept by the drift metrics per step", _probe_row(r["probe_memory"])),
        *_routing_data_rows(r["routing_data"]),
        *_checkpoint_rows(r["checkpoint"]),
        *_weight_sync_rows(r["weight_sync"]),
        (
            "replay r2 / r3 step time vs none",
            f"{r['routing_overhead']['r2']:.3f}x / {r['routing_overhead']['r3']:.3f}x",
        ),
        *_padding_rows(r["padding"]),
        (
            "drift metrics on / + after-update pass",
            f"{r['routing_overhead']['drift metrics']:.3f}x / {r['routing_overhead']['drift + after-update pass']:.3f}x",
        ),
        (
            f"log-probs vocab 151,936 x seq {lp['seq']}: memory",
            f"chunked {lp['chunked_growth_mib']:.0f} MiB vs full logits {lp['naive_growth_mib']:.0f} MiB = {lp['memory_ratio_chunked_over_naive']:.3f}x",
        ),
        (
            "  time",
            f"{lp['chunked_seconds']:.1f}s vs {lp['naive_seconds']:.1f}s = {lp['time_ratio_chunked_over_naive']:.2f}x",
        ),
        ("local engine (tiny Qwen3-MoE)", f"{ro['local_tokens_per_s']:.0f} tokens/s"),
        (
            "SGLang client overhead per request",
            f"{ro['ms_per_request_concurrency_1']:.2f} ms (HTTP round trip on loopback incl. JSON, 1 at a time)",
        ),
    ]
    if isinstance(r["peer"], dict):
        pe = r["peer"]
        rows.append(
            (
                f"GRPO step vs TRL (same model, batch; {pe['runs']} runs taking turns)",
                f"median of {pe['turns']} turn ratios {pe['median_turn_time_ratio']:.2f}x; step medians moe-rl "
                f"{pe['moe_rl_step_s']:.3f}s vs TRL {pe['trl_step_s']:.3f}s = {pe['time_ratio_moe_rl_over_trl']:.2f}x",
            )
        )
        runs = ", ".join(f"{x:.2f}x" for x in pe["run_time_ratios"])
        rows.append(
            (
                "  time, run by run / turn by turn",
                f"{runs} / median {pe['median_turn_time_ratio']:.2f}x of {pe['turns']} turns",
            )
        )
        tokens = pe["response_tokens"]
        rows.append(("  mean response tokens", f"moe-rl {tokens['moe-rl']:.2f}, TRL {tokens['trl']:.2f}"))
        rows.append(
            (
                "  peak RSS",
                f"{pe['moe_rl_peak_rss_mib']:.0f} vs {pe['trl_peak_rss_mib']:.0f} MiB = {pe['memory_ratio_moe_rl_over_trl']:.2f}x",
            )
        )
    else:
        rows.append(("GRPO step vs TRL", r["peer"]))
    st = r["stages"]
    rows.append(
        (
            "moe-rl step by stage (same model, batch)",
            f"medians of {st['steps']} steps, perf/step_time_s {st['perf_step_ms']:.1f} ms; ms, % of train_step:",
        )
    )
    step_ms = next((x["median_ms"] for x in st["stages"] if x["stage"] == "train_step"), 0.0)
    for x in st["stages"]:
        if x["median_ms"] >= 0.05 or x["depth"] <= 1:
            share = f"  {100 * x['median_ms'] / step_ms:5.1f}%" if step_ms and not x["stage"].endswith("other") else ""
            name = "(other)" if x["stage"].endswith(": other") else x["stage"]
            rows.append((f"  {'  ' * x['depth']}{name}", f"{x['median_ms']:7.2f}{share}"))
    losses = r["losses"]["losses"]
    rows.append(
        (f"losses fwd+bwd {r['losses']['shape']}", ", ".join(f"{k} {v['ms']:.0f}ms" for k, v in losses.items()))
    )
    rows.append(("GPU", r["gpu"]))
    return rows


if __name__ == "__main__":
    main()
