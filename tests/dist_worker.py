"""Multi-process checks of the megatron backend, started N times by ``spawn_local``.

For each layout given, it builds the model from one HF checkpoint and saves, from the
ranks that own them: log-probs of a fixed batch (forward only), full gradients in HF
names of a fixed loss (data split over data-parallel ranks), and the loss over a few
optimizer steps. The pytest side compares them with the single-process run.

    python tests/dist_worker.py HF_DIR OUT_DIR tp,pp,ep,etp [tp,pp,ep,etp ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.models.architectures import model_dims
from moe_rl.models.builder import build_model, load_hf_config, make_transformer_config
from moe_rl.models.forward import MicroBatch, run_microbatches
from moe_rl.models.hf_weights import gather_hf_tensors, load_hf_weights
from parallel.distributed import init_distributed
from parallel.layout import ParallelLayout
from parallel.optim import OptimSettings, build_optimizer, train_step, wrap_ddp

SEQ, NUM_SEQS, TRAIN_STEPS = 12, 4, 3


def fixed_batch(vocab: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(0, vocab, (NUM_SEQS, SEQ), generator=gen)
    weights = torch.rand(NUM_SEQS, SEQ - 1, generator=gen)
    return [MicroBatch(ids[i : i + 1], extras={"w": weights[i : i + 1]}) for i in range(NUM_SEQS)]


def loss_fn(logp_entropy: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    # log-probs and entropy both carry gradient (the entropy through the vocab-parallel path)
    per_token = logp_entropy[..., 0] * mb.extras["w"] + 0.1 * logp_entropy[..., 1]
    loss = -per_token.sum() / (NUM_SEQS * (SEQ - 1))
    return loss, {"loss": loss.detach()}


def main() -> None:
    hf_dir, out_dir, *layouts = sys.argv[1:]
    hf_config = load_hf_config(hf_dir)
    batch = fixed_batch(hf_config.vocab_size)
    for spec in layouts:
        tp, pp, ep, etp = (int(x) for x in spec.split(","))
        layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)
        init_distributed(layout, model_dims(hf_config), seed=0)
        from megatron.core import parallel_state as ps

        rank = dist.get_rank()
        out = Path(out_dir) / spec.replace(",", "-")
        out.mkdir(parents=True, exist_ok=True)
        reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        my_batches = batch[dp_rank::dp_size]

        def fresh(distributed_optimizer: bool):
            config = make_transformer_config(hf_config, layout)
            model = build_model(hf_config, config)
            load_hf_weights(model, hf_config, hf_dir)
            if hasattr(model, "logprob_config") and dist.get_world_size() > 1:
                model.logprob_config.chunk_size = 5  # several sequence chunks (reference: one)
            settings = OptimSettings(lr=3e-3, use_distributed_optimizer=distributed_optimizer)
            ddp = wrap_ddp(model, config, settings)
            return ddp, settings

        # 1. log-probs, forward only, whole batch on every rank
        ddp, settings = fresh(False)
        results = run_microbatches([ddp], batch, forward_only=True)
        if reporter:
            torch.save(torch.cat([r["logprobs"] for r in results]), out / "logp.pt")
            torch.save(torch.cat([r["entropy"] for r in results]), out / "entropy.pt")

        # 2. gradients of the fixed loss, data split over data-parallel ranks
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp.zero_grad_buffer()
        run_microbatches([ddp], my_batches, loss_fn=loss_fn, forward_only=False)
        finalize_model_grads([ddp])
        grads = gather_hf_tensors(ddp.module, hf_config, source=lambda name, p: p.main_grad)
        if grads:
            torch.save(grads, out / f"grads_rank{rank}.pt")

        # 3. a few optimizer steps with the distributed optimizer
        ddp, settings = fresh(True)
        optimizer = build_optimizer([ddp], settings)
        losses = []
        for _ in range(TRAIN_STEPS):
            result = train_step([ddp], optimizer, lambda: run_microbatches([ddp], my_batches, loss_fn=loss_fn, forward_only=False))
            local = torch.tensor(sum(float(r["loss"]) for r in result.outputs))
            if ps.is_pipeline_last_stage():
                dist.all_reduce(local, group=ps.get_data_parallel_group())
            losses.append(float(local))
        if reporter:
            torch.save(torch.tensor(losses), out / "losses.pt")
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
