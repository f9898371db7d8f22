"""Weight sync: the first rank's peak extra memory and time per bucket size.

    .venv/bin/python tools/bench_weight_sync.py [--layers 4] [--buckets 16,64,256] [--json FILE]

A random Qwen3-MoE (hidden 1024, 32 experts of 512, vocab 32k; about 55M parameters a
layer) on 2 processes with EP=2, so rank 1's experts travel to rank 0 point to point.
Its weights stream to rank 0 in bf16 buckets (`rollout.weight_sync=distributed`: what
rank 0 then broadcasts to the servers, which adds no memory on the sender), one fresh
pair of processes per bucket size; "whole" is one bucket of everything, the whole model
on rank 0 (what `gather()`, the in-process engine's sync, holds). The figure is rank 0's peak memory during the sync minus its
memory just before (CUDA: allocated bytes; CPU: resident set sampled every 2 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


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


def worker(hf_dir: str, bucket_mb: float, out: str) -> None:
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
        result = {"bucket_mb": bucket_mb or "whole", "buckets": buckets, "extra_mb": round(sampler.extra_mb, 1),
                  "model_mb_bf16": round(total, 1), "seconds": round(seconds, 2)}  # fmt: skip
        Path(out).write_text(json.dumps(result))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--buckets", default="16,64,256", help="bucket sizes in MiB (the whole-model gather is added)")
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], float(args.worker[1]), args.worker[2])
        return
    from moe_rl.models.tiny import tiny_config
    from parallel.launch import spawn_local

    tmp = Path(tempfile.mkdtemp())
    size = dict(hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=args.layers, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4, vocab_size=32000)  # fmt: skip
    hf_dir = str(tmp / "hf")
    tiny_config("qwen3_moe", **size).save_pretrained(hf_dir)  # the config is all the workers need
    rows = []
    for bucket_mb in [float(b) for b in args.buckets.split(",")] + [0.0]:
        out = tmp / f"r{bucket_mb}.json"
        # glibc returns large frees to the OS at once (else its moving mmap threshold keeps them in RSS)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
        code = spawn_local(2, [str(Path(__file__).resolve()), "--worker", hf_dir, str(bucket_mb), str(out)], timeout_s=900, env=env)
        if code != 0:
            raise SystemExit(f"worker for bucket {bucket_mb} MiB failed with exit code {code}")
        rows.append(json.loads(out.read_text()))
        r = rows[-1]
        print(f"bucket {str(r['bucket_mb']):>6} MiB: {r['buckets']:3d} bucket(s), rank 0 extra peak {r['extra_mb']:8.1f} MiB "
              f"of a {r['model_mb_bf16']:.0f} MiB model (bf16), {r['seconds']:.2f} s", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
