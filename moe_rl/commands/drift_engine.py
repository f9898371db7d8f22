"""``moe-rl drift --engine URL --checkpoint CKPT``: train-inference routing drift.

The engine (SGLang servers) generates from the prompts and returns each token's routed
experts and log-prob; the trainer's model (megatron-core, under any parallel layout)
recomputes routing and log-probs for the same tokens from the checkpoint, exactly as a
training step's old-policy pass does. Written to ``--out``: ``drift.json`` (per-layer
changed fraction, tokens changed in any layer, log-prob mismatch overall and for tokens
whose routing differed vs agreed), TensorBoard events and a layers x experts heatmap of
the disagreement. Router KL is not available: SGLang returns only the chosen experts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import PretrainedConfig

from moe_rl.rollout.types import RolloutError, Sample


def run_rank(args: argparse.Namespace) -> int:
    """One process of the measurement (every rank of the layout runs it)."""
    from moe_rl.commands._distributed import layout_from
    from moe_rl.commands.export import model_dir_of
    from moe_rl.models.architectures import load_hf_config, model_dims
    from parallel.collectives import broadcast_object, is_first_rank
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.peer_failure import announce_failure

    hf_dir = str(model_dir_of(args.checkpoint).resolve())  # absolute: --sync-weights hands it to the servers
    hf_config = load_hf_config(hf_dir)
    layout = layout_from(args)
    init_distributed(layout, model_dims(hf_config), seed=args.seed)
    try:
        outcome = _generate_on_first_rank(args, hf_dir, hf_config) if is_first_rank() else None
        shared = broadcast_object(outcome)  # every rank stops on the first rank's error
        assert shared is not None  # (the first rank's)
        status, samples, version = shared
        if status == "error":
            if is_first_rank():
                raise ValueError(samples)
            return 2  # the first rank reports it
        drift, mismatch = _measure(args, hf_dir, hf_config, layout, samples)
        if is_first_rank():
            _write_report(args, hf_dir, samples, version, drift, mismatch)
        return 0
    except BaseException as e:
        announce_failure(e)  # the other ranks may be waiting for this one
        raise
    finally:
        destroy_distributed()


def _generate_on_first_rank(args: argparse.Namespace, hf_dir: str, hf_config: PretrainedConfig) -> tuple:
    """``("ok", samples, weight_version)`` or ``("error", message, "")``: never raises, so
    that the other ranks, waiting for the samples, always hear of a failure."""
    try:
        return ("ok", *_generate(args, hf_dir, hf_config))
    except (RolloutError, ValueError, OSError) as e:
        return ("error", str(e), "")
    except Exception as e:  # a bug: its traceback, and the others stop too
        import traceback

        traceback.print_exc()
        return ("error", f"{type(e).__name__}: {e}", "")


def _generate(args: argparse.Namespace, hf_dir: str, hf_config: PretrainedConfig) -> tuple[list[Sample], str]:
    """The first rank: the engine's samples with routed experts, and its weight version."""
    from moe_rl.commands.prompt_file import read_prompts
    from moe_rl.models.architectures import architecture_of
    from moe_rl.rollout.sglang.engine import SGLangEngine
    from moe_rl.rollout.types import SamplingParams

    prompts = read_prompts(args.prompts, args.tokenizer or hf_dir, args.max_prompts)
    if max(max(p) for p in prompts) >= hf_config.vocab_size:
        raise ValueError(f"a prompt token id is outside the vocabulary of {hf_dir} ({hf_config.vocab_size})")
    engine = SGLangEngine(
        args.engine,
        num_layers=hf_config.num_hidden_layers,
        top_k=hf_config.num_experts_per_tok,
        num_experts=architecture_of(hf_config).num_experts(hf_config),
    )
    try:
        engine.wait_healthy(timeout_s=args.wait_s)
        missing = engine.servers_without_routed_experts()
        if missing:
            raise RolloutError(
                f"{', '.join(missing)} do(es) not return routed experts: start SGLang with --enable-return-routed-experts"
            )
        if args.sync_weights:
            engine.update_weights_from_disk(hf_dir, "moe-rl-drift")
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=_stop_ids(hf_config)
        )
        groups = engine.generate(prompts, args.samples, params, seed=args.seed, return_routed_experts=True)
        return [s for g in groups for s in g], engine.weight_version
    finally:
        engine.close()


def _stop_ids(hf_config: PretrainedConfig) -> tuple[int, ...]:
    """The model's end-of-sequence token(s) from its config."""
    eos = getattr(hf_config, "eos_token_id", None)
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def _measure(
    args, hf_dir: str, hf_config: PretrainedConfig, layout, samples: list[Sample]
) -> tuple[dict, dict[str, float]]:
    """Collective: the trainer's routing and log-probs of the samples on this rank's
    data-parallel share; the ``train_vs_rollout`` routing metrics and the log-prob mismatch."""
    from moe_rl.models.architectures import architecture_of
    from moe_rl.models.forward import run_microbatches
    from moe_rl.models.logprob_head import LogProbConfig
    from moe_rl.routing.monitor import RoutingMonitor
    from moe_rl.experience.types import Experience
    from moe_rl.trainer.batch import build_train_batch
    from moe_rl.algorithms.metric_spec import ROLLOUT_MISMATCH_METRICS
    from moe_rl.trainer.metrics import logp_mismatch_scalars, reduce_metrics
    from moe_rl.trainer.rollout_mismatch import measure_rollout_mismatch
    from moe_rl.trainer.old_policy import StepRouting, old_policy_pass
    from moe_rl.trainer.policy import build_reference
    from moe_rl.trainer.packing import MicroBatchPlanner
    from parallel.collectives import rank_device

    model = build_reference(hf_config, hf_dir, layout, LogProbConfig(temperature=args.temperature))  # frozen, eval mode
    exp = Experience(samples, torch.zeros(len(samples), 0), [], torch.zeros(len(samples)))
    plan = MicroBatchPlanner(args.micro_batch_size, seq_len_multiple=layout.seq_len_multiple).plan(exp.lengths)
    batch = build_train_batch(
        exp, 0, plan, seq_len_multiple=layout.seq_len_multiple, pad_id=0, device=rank_device(), with_routing=True
    )
    mbs = batch.micro_batches
    num_experts = architecture_of(hf_config).num_experts(hf_config)
    # SGLang returns no router scores
    monitor = RoutingMonitor(model, hf_config.num_hidden_layers, num_experts, router_kl=False)
    outputs = old_policy_pass(
        lambda batches, hooks: run_microbatches(model, batches, hooks=hooks),
        mbs,
        StepRouting(model, num_experts, monitor=monitor),
        engine_routing=True,
    )
    values = measure_rollout_mismatch([out["logprobs"] for out in outputs], mbs, monitor)
    mismatch = logp_mismatch_scalars(reduce_metrics(values, ROLLOUT_MISMATCH_METRICS))
    return monitor.reduce().get("train_vs_rollout", {}), mismatch


def _write_report(
    args, hf_dir: str, samples: list[Sample], version: str, drift: dict, mismatch: dict[str, float]
) -> None:
    """``drift.json``, TensorBoard events and the disagreement heatmap; one summary line."""
    from torch.utils.tensorboard import SummaryWriter

    from moe_rl import tags
    from moe_rl.routing.drift import summarize
    from moe_rl.routing.tensorboard import heatmap_figure, log_routing

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = drift["drift_layers"].tolist()
    split = {
        k: float(drift[k]) if k in drift else None
        for k in ("logp_mismatch_routing_changed", "logp_mismatch_routing_same")
    }
    report = {
        "engine": list(args.engine),
        "checkpoint": hf_dir,
        "engine_weight_version": version,
        "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "etp": args.etp},
        "samples": len(samples),
        "routed_tokens": sum(len(s.prompt_ids) + len(s.output_ids) - 1 for s in samples),
        "response_tokens": sum(len(s.output_ids) for s in samples),
        "layers": layers,
        "metrics": summarize({k: drift[k] for k in ("changed_frac", "expert_change_frac", "any_layer_changed_frac")}),
        "expert_disagreement": drift["expert_disagreement"].tolist(),
        "logp_mismatch": {
            **mismatch,
            **split,
            "routing_changed_response_frac": float(drift.get("routing_changed_response_frac", 0.0)),
        },
        "router_kl": None,  # SGLang returns the chosen experts only, not the router's distribution
    }
    # the local engine's simulated mismatch that reproduces these flips (its per-layer target: their mean)
    report["simulate_with"] = (
        f"rollout.simulate_mismatch.router_flip_frac={report['metrics']['changed_frac']['mean']:.3g}"
    )
    (out / "drift.json").write_text(json.dumps(report, indent=2))
    with SummaryWriter(str(out / "tensorboard")) as writer:
        log_routing(writer, 0, drift, group="train_vs_rollout")
        for key, value in mismatch.items():
            writer.add_scalar(tags.train(key), value, 0)
    fig = heatmap_figure(
        drift["expert_disagreement"], layers, "tokens routed to the expert by one side only", normalize=False
    )
    fig.savefig(out / "expert_disagreement_heatmap.png", dpi=100)
    m = report["metrics"]
    print(
        f"train-inference routing drift over {report['routed_tokens']} tokens ({len(samples)} samples), {len(layers)} MoE layers: "
        f"changed_frac {m['changed_frac']['mean']:.4f}, any_layer_changed_frac {m['any_layer_changed_frac']['mean']:.4f}, "
        f"logp mismatch {mismatch['logp_mismatch_mean']:.3e} (routing changed: {_fmt(split['logp_mismatch_routing_changed'])}, "
        f"same: {_fmt(split['logp_mismatch_routing_same'])}) -> {out / 'drift.json'}"
    )
    print(f"to study this engine's routing mismatch with the local engine (a simulation): {report['simulate_with']}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3e}"
