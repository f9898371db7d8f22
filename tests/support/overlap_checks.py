"""``optim.overlap_grad_reduce`` against it off, on every rank of a data-parallel job
(run by test_optim under 2 gloo ranks): steps of 3, 1 and 2 micro-batches (dynamic
sampling varies the count), each rank its own data. Rank 0 prints one JSON line: the
largest weight difference after each step."""

import json
import os
import sys

if "RANK" not in os.environ:  # the launcher: two ranks of this script
    from parallel.launch import spawn_local

    sys.exit(spawn_local(2, [__file__, *sys.argv[1:]]))

import torch
import torch.distributed as dist

from moe_rl.models.builder import build_model, make_transformer_config
from moe_rl.models.forward import run_microbatches
from moe_rl.models.hf_weights import load_hf_weights
from one_process import random_micro_batches, start_one_process
from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

COUNTS = (3, 1, 2)
hf_dir = sys.argv[1]
hf_config, layout = start_one_process(hf_dir)


def loss_fn(le, mb):
    return -le[..., 0].sum() / 40, {}


def weights_after_each_step(overlap: bool, distributed_optimizer: bool) -> list[dict]:
    config = make_transformer_config(hf_config, layout)
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, hf_dir)
    settings = OptimSettings(lr=1e-3, overlap_grad_reduce=overlap, use_distributed_optimizer=distributed_optimizer)
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own tokens
    out = []
    for count in COUNTS:
        batches = random_micro_batches([9, 6], gen, count=count)
        train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False))
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


result = {}
for distributed_optimizer in (False, True):
    off, on = (
        weights_after_each_step(False, distributed_optimizer),
        weights_after_each_step(True, distributed_optimizer),
    )
    result[f"max_diff_distributed_{distributed_optimizer}"] = [
        max(float((a[n] - b[n]).abs().max()) for n in a) for a, b in zip(off, on)
    ]
    result[f"moved_distributed_{distributed_optimizer}"] = [
        sum(int((a[n] != b[n]).sum()) for n in a) for a, b in zip(off, off[1:])
    ]
if dist.get_rank() == 0:
    print(json.dumps(result), flush=True)
sys.stdout.flush()
# skip interpreter teardown: gloo's threads still alive then abort a rank now and then under
# load ("terminate called without an active exception"), after the results are out
os._exit(0)
