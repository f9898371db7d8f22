"""What the KL penalty's reference policy costs: memory on the device between steps and
the reference pass's time, `algorithm.reference=device` (a second model) vs `host`
(starting weights kept in host memory, swapped into the policy for the pass).

    .venv/bin/python -m tools.bench.reference [--tokens 1024] [--repeats 3] [--json FILE]

One process, the random 188M-parameter Qwen3-MoE of tools/bench/mfu.py. Memory is
counted from the tensors each mode holds, by the device they live on (on CUDA also
read from the allocator); on a CPU-only machine "device" and "host" are the same RAM,
so the figure that matters at scale is the device column. Time: each mode's reference
pass next to a plain policy log-prob pass of the same batch, interleaved.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def main() -> None:
    from tools.bench.mfu import parse_args, random_batches, random_policy

    args = parse_args(__doc__, tokens=1024)

    from moe_rl.models.builder import build_model
    from moe_rl.trainer.policy import DeviceReference, HostReference
    from parallel.collectives import rank_device

    policy, config = random_policy()
    model, hf_config, device = policy.model, policy.hf_config, rank_device()
    batches = random_batches(args.tokens, device=device)

    before = allocated()
    host = HostReference.snapshot(policy)
    host_alloc = allocated() - before
    before = allocated()
    second = build_model(hf_config, config).eval()
    second.load_state_dict(model.state_dict())
    dev = DeviceReference(second)
    dev_alloc = allocated() - before
    stage = nbytes(model.state_dict().values())
    held = host.weights.tensors + host.trained.tensors  # the snapshot, and the buffer the trained weights wait in
    on_host = nbytes(w for w in held if w.device.type == "cpu")
    memory = {  # the second model lives on the model's device; the host mode's buffers in host memory
        "device": {"device_bytes": nbytes(second.state_dict().values()), "host_bytes": 0, "cuda_allocated": dev_alloc},
        "host": {"device_bytes": nbytes(held) - on_host, "host_bytes": on_host, "cuda_allocated": host_alloc},
    }

    passes = {
        "policy": lambda: policy.logprobs(batches),
        "device": lambda: dev.logprobs(batches),
        "host": lambda: host.logprobs(batches),
    }
    for run in passes.values():  # warm-up
        with torch.no_grad():
            run()
    times: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(args.repeats):
        for name, run in passes.items():
            start = time.perf_counter()
            with torch.no_grad():
                run()
            times[name].append(time.perf_counter() - start)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    mib = 2**20
    print(f"model stage: {stage / mib:.0f} MiB; {args.tokens} tokens; device {device}")
    for mode in ("device", "host"):
        m = memory[mode]
        print(
            f"reference={mode:<6} device {m['device_bytes'] / mib:7.0f} MiB  host {m['host_bytes'] / mib:7.0f} MiB  "
            f"pass {seconds[mode] * 1e3:7.0f} ms = {seconds[mode] / seconds['policy']:.2f}x the policy's log-prob pass"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"stage_bytes": stage, "tokens": args.tokens, "memory": memory, "seconds": seconds}, indent=2)
        )


if __name__ == "__main__":
    main()
