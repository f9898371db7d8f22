"""One training step of the built-in model under several parallel layouts, in one set of
processes (started N times by ``spawn_local``); rank 0 writes each run's step scalars.

    python tests/support/trainer_layouts_worker.py OUT_DIR CACHE_DIR NAME:tp,pp,ep,etp:VARIANT[:STEPS[:save=OTHER]] ...

(STEPS: steps to run, default 1; the last step's scalars are written. ``save=OTHER``: then
checkpoint, and copy the checkpoint into run OTHER's directory, which a later set of
processes (another layout) resumes from and runs to its STEPS.)

VARIANT: none | r2 | r3 (with activation recompute) | kl (KL to the reference policy), with
``+dyn``: micro-batches packed under a token budget (e.g. ``kl+dyn``), ``+qwen2`` / ``+olmoe``
/ ``+glm`` / ``+dsv3``: the built-in model in that family; ``+l3``: with 3 layers; ``+async``: asynchronous rollouts;
``mt``: multi-turn samples with environment tokens; ``+half``: the drift metrics on half the tokens;
``+sim``: the engine's simulated routing mismatch (``+simlogit``: and logit perturbation).
The pytest side compares every layout with the one-process run of the same variant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TINY = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=5",
    "rollout.max_new_tokens=5",
    "warm_start.steps=20",
    "warm_start.batch_size=16",
    "train.progress=false",
    "algorithm.micro_batch_size=4",
    "algorithm.updates_per_batch=1",
    "routing.after_update_pass=false",
    "train.collective_timeout_min=45",
]
VARIANTS = {
    "none": [],
    "r2": ["routing.replay=r2"],
    "r3": ["routing.replay=r3", "routing.recompute_activations=true"],
    "kl": ["algorithm.kl_coef=0.1"],  # the reference swapped in from host memory (the default)
    "kldev": ["algorithm.kl_coef=0.1", "algorithm.reference=device"],  # ... or a second model
    "dyn": ["algorithm.max_tokens_per_micro_batch=24"],  # micro-batches of varying shapes (pipeline: shapes exchanged)
    "half": ["routing.metrics_sample_frac=0.5"],  # the drift metrics observe a seeded half of each micro-batch
    # the built-in model in another family (GLM-4.5: sigmoid router whose expert bias moves 0.01 per update)
    # (a short warm start: these runs check mechanics, not learning)
    "qwen2": ["model.architecture=qwen2_moe", "warm_start.steps=4"],
    "olmoe": ["model.architecture=olmoe", "warm_start.steps=4"],
    "glm": [
        "model.architecture=glm4_moe",
        "warm_start.steps=4",
        "routing.expert_bias_update_rate=0.01",
        "routing.after_update_pass=true",
    ],
    "dsv3": ["model.architecture=deepseek_v3", "warm_start.steps=4", "routing.expert_bias_update_rate=0.01"],
    # 3 layers: no even split over 2 pipeline stages (megatron-core's uneven stages, 2 + 1)
    "l3": ["model.num_layers=3", "warm_start.steps=4"],
    # step k+1 generated while step k trains (the runs here take exactly train.steps steps)
    "async": ["rollout.async_rollouts=true", "algorithm.old_logprobs=rollout", "train.steps=3"],
    # a simulated train-inference mismatch: the engine's routing perturbed (rollout.simulate_mismatch,
    # selection only: gate values from the clean logits), and with its logits perturbed too
    "sim": ["rollout.simulate_mismatch.router_flip_frac=0.2"],
    "simlogit": ["rollout.simulate_mismatch.router_flip_frac=0.2", "rollout.simulate_mismatch.logit_kl=2e-3"],
    # multi-turn samples (two policy turns around inserted tokens: tests/support/multi_turn_fns.py), R3
    "mt": ["rollout.multi_turn.generate_fn=multi_turn_fns:two_turns", "routing.replay=r3"],
}


def process_group_facts() -> dict:
    """The default process group's collective timeout and the NCCL environment it started with."""
    import os

    import torch
    import torch.distributed as dist

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return {
        "timeout_s": backend.options._timeout.total_seconds(),
        "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE"),
    }


def main() -> None:
    # imported here: a checkpoint's writer pool is started by spawning, which imports this script again
    import shutil

    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl.config import load_config
    from moe_rl.trainer.trainer import Trainer
    from parallel.collectives import is_first_rank
    from parallel.distributed import destroy_distributed

    out, cache = Path(sys.argv[1]), sys.argv[2]
    for spec in sys.argv[3:]:
        name, layout, variant, *rest = spec.split(":")
        steps, save_for = rest[:1], rest[1].removeprefix("save=") if len(rest) > 1 else None
        tp, pp, ep, etp = layout.split(",")
        chosen = [o for part in variant.split("+") for o in VARIANTS[part]]
        overrides = [
            *TINY,
            *chosen,
            f"warm_start.cache_dir={cache}",
            f"train.run_dir={out / name}",
            f"parallel.tp={tp}",
            f"parallel.pp={pp}",
            f"parallel.ep={ep}",
            f"parallel.etp={etp}",
        ]
        RouterReplay.clear_global_router_replay_instances()  # the previous run's model
        with Trainer(load_config(None, overrides)) as trainer:
            last = int(steps[0]) if steps else 1
            for step in range(trainer.start_step, last):
                scalars = trainer.train_step(step)
            held = _routing_held(trainer)
            if save_for:
                trainer.save_checkpoint(last, scalars)
                trainer.checkpointer.wait()
                if is_first_rank():
                    shutil.copytree(out / name / "checkpoints", out / save_for / "checkpoints")
        if is_first_rank():
            (out / f"{name}.json").write_text(json.dumps(scalars))
            (out / f"{name}.process_group.json").write_text(json.dumps(process_group_facts()))
            (out / f"{name}.routing_held.json").write_text(json.dumps(held))
    destroy_distributed()


def _routing_held(trainer) -> dict:
    """What the step's routing parts still hold after it (freed before the next rollout)."""
    routing = trainer.routing
    if routing is None:
        return {}
    held = {}
    if routing.replay:
        held["replay_indices"] = len(routing.replay.indices)
    if routing.monitor:
        monitor = routing.monitor
        held["monitor"] = len(monitor._old) + len(monitor._masks) + len(monitor._stats) + len(monitor._engine or [])
    return held


if __name__ == "__main__":
    main()
