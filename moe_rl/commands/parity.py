"""``moe-rl parity``: megatron-core log-probs of an HF checkpoint, under a parallel
layout, against transformers' own model on the same weights."""

from __future__ import annotations

import argparse

HELP = "compare sharded megatron log-probs with transformers on one HF checkpoint"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from moe_rl.commands._distributed import add_layout_args

    p = sub.add_parser("parity", help=HELP, description=HELP)
    p.add_argument("--hf-dir", required=True, help="local Hugging Face model directory")
    p.add_argument("--batch", type=int, default=4, help="sequences in the fixed batch")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs log-prob difference allowed")
    add_layout_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_rl.commands._distributed import LayoutError, fail, maybe_spawn

    try:
        spawned = maybe_spawn(args, "parity")
    except LayoutError as e:
        return fail(str(e))
    if spawned is not None:
        return spawned
    try:
        return _run_rank(args)
    except (LayoutError, ValueError, FileNotFoundError) as e:
        return fail(str(e))


def _run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from moe_rl.commands._distributed import layout_from
    from moe_rl.models.architectures import load_hf_config, model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.forward import MicroBatch, run_microbatches
    from moe_rl.models.hf_weights import load_hf_weights
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.peer_failure import announce_failure

    hf_config = load_hf_config(args.hf_dir)
    layout = layout_from(args)
    init_distributed(layout, model_dims(hf_config), seed=args.seed)
    from megatron.core import parallel_state as ps

    try:
        config = make_transformer_config(hf_config, layout, params_dtype=torch.float32)
        model = build_model(hf_config, config)
        load_hf_weights(model, hf_config, args.hf_dir)
        model.eval()
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, hf_config.vocab_size, (args.batch, args.seq_len), generator=gen)
        results = run_microbatches(model, [MicroBatch(ids[i : i + 1]) for i in range(args.batch)])
        reporter = (
            ps.is_pipeline_last_stage()
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0
        )
        verdict = torch.zeros(1)
        if reporter:
            ours = torch.cat([r["logprobs"] for r in results])
            our_entropy = torch.cat([r["entropy"] for r in results])
            theirs, their_entropy = (
                t.to(ours.device) for t in transformers_logprobs(args.hf_dir, ids)
            )  # transformers runs on CPU
            diff = (ours - theirs).abs().max().item()
            entropy_diff = (our_entropy - their_entropy).abs().max().item()
            ok = max(diff, entropy_diff) <= args.tolerance
            print(
                f"parity tp={layout.tp} pp={layout.pp} ep={layout.ep} etp={layout.expert_tp} "
                f"({hf_config.model_type}, {args.batch}x{args.seq_len} tokens): "
                f"max |logp_megatron - logp_transformers| = {diff:.3e}, entropy {entropy_diff:.3e} "
                f"{'<=' if ok else '>'} {args.tolerance:g}: {'OK' if ok else 'FAILED'}",
                flush=True,
            )
            verdict.fill_(0.0 if ok else 1.0)
        dist.all_reduce(verdict)
        return 1 if verdict.item() > 0 else 0
    except BaseException as e:
        announce_failure(e)  # the other ranks may be waiting for this one
        raise
    finally:
        destroy_distributed()


def transformers_logprobs(hf_dir: str, ids):
    """transformers' fp32 log-probs of ``ids[:, 1:]`` and entropies ``[b, s-1]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits.float()[:, :-1]
    logp = torch.log_softmax(logits, -1)
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), entropy
