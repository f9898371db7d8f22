"""One-process optimizer checks (run by test_optim): which optimizer the default settings
build, and that the first Adam step is the textbook one (fused kernel, sharded or not, and
the multi-tensor one). Prints one JSON line."""

import json
import sys

import torch

from moe_rl.models.builder import build_model, make_transformer_config
from moe_rl.models.forward import run_microbatches
from moe_rl.models.hf_weights import load_hf_weights
from parallel.optim import (
    OptimSettings,
    build_lr_scheduler,
    build_optimizer,
    shards_optimizer_state,
    train_step,
    wrap_ddp,
)

from one_process import random_micro_batches, start_one_process

LR, EPS = 1e-3, 1e-8
hf_dir = sys.argv[1]
hf_config, layout = start_one_process(hf_dir)
gen = torch.Generator().manual_seed(0)
batches = random_micro_batches([10, 7], gen)


def loss_fn(le, mb):
    return -le[..., 0].sum() / 40, {}


def first_step(distributed: bool | None, fused: bool = True, router_lr_mult: float = 1.0) -> dict:
    """Weights before and after one step (at the schedule's first rate), the gradients it used,
    and its optimizer's setup."""
    config = make_transformer_config(hf_config, layout)
    model = build_model(hf_config, config)
    load_hf_weights(model, hf_config, hf_dir)
    settings = OptimSettings(
        lr=LR,
        adam_eps=EPS,
        clip_grad=0.0,
        use_distributed_optimizer=distributed,
        fused_adam=fused,
        router_lr_mult=router_lr_mult,
    )
    ddp = wrap_ddp(model, config, settings)
    optimizer = build_optimizer([ddp], settings)
    build_lr_scheduler(optimizer, settings, total_steps=1).set_step(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step([ddp], optimizer, lambda: run_microbatches([ddp], batches, loss_fn=loss_fn, forward_only=False))
    inner = [part.optimizer for part in optimizer.chained_optimizers]
    return {
        "sharded": shards_optimizer_state(settings),
        "kernels": sorted({f"fused={g['fused']} foreach={g['foreach']}" for opt in inner for g in opt.param_groups}),
        "before": before,
        "after": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.main_grad.detach().clone() for n, p in model.named_parameters()},
    }


auto, sharded, foreach = first_step(None), first_step(True), first_step(None, fused=False)
fast_routers = first_step(None, router_lr_mult=10.0)


def textbook_error(step: dict, lr_of=lambda name: LR) -> float:
    """Adam's first step with bias correction: w - lr * g / (|g| + eps) (no weight decay, no clipping)."""
    return max(
        float((step["after"][n] - (step["before"][n] - lr_of(n) * g / (g.abs() + EPS))).abs().max())
        for n, g in step["grads"].items()
    )


textbook = textbook_error(auto)
routers = [n for n in fast_routers["before"] if n.endswith("router.weight")]
router_textbook = textbook_error(fast_routers, lambda n: LR * 10.0 if n in routers else LR)
moved = sum(int((auto["after"][n] != auto["before"][n]).sum()) for n in auto["before"])
same = max(float((auto["after"][n] - sharded["after"][n]).abs().max()) for n in auto["after"])
kernels_differ = max(float((auto["after"][n] - foreach["after"][n]).abs().max()) for n in auto["after"])
from megatron.core.optimizer import clip_grads  # noqa: E402

from parallel import megatron_compat  # noqa: E402

print(
    json.dumps(
        {
            "auto_sharded": auto["sharded"],
            "explicit_sharded": sharded["sharded"],
            "auto_kernels": auto["kernels"],
            "foreach_kernels": foreach["kernels"],
            "fused_vs_foreach_max_diff": kernels_differ,
            "textbook_max_err": textbook,
            "router_lr_mult_textbook_max_err": router_textbook,
            "routers": len(routers),
            "moved": moved,
            "auto_vs_sharded_max_diff": same,
            "grad_norm_and_clip_kernels": [
                clip_grads.l2_norm_impl is megatron_compat.foreach_l2_norm,
                clip_grads.multi_tensor_scale_impl is megatron_compat.foreach_scale,
            ],
        }
    )
)
