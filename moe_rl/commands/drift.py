"""``moe-rl drift``: routing drift on a prompt set, written as ``drift.json``, TensorBoard
events and a PNG heatmap:

- ``--a A --b B``: between two checkpoints (transformers) or two saved routings;
- ``--engine URL --checkpoint CKPT``: between a rollout engine (SGLang) and the trainer's
  model on the same tokens (:mod:`moe_rl.commands.drift_engine`), under any layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "routing drift: two checkpoints (--a/--b), or a rollout engine against the trainer (--engine/--checkpoint)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from moe_rl.commands._distributed import add_layout_args

    p = sub.add_parser("drift", help=HELP, description=HELP)
    p.add_argument(
        "--a",
        help="HF model directory (a training checkpoint: its model/), or a routing file (.safetensors, moe_rl.routing.encoding.save_routing)",
    )
    p.add_argument("--b", help="the same, to compare with --a")
    p.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="the model's experts, for routing files that record none (the expert load counts every expert)",
    )
    p.add_argument(
        "--engine",
        nargs="+",
        metavar="URL",
        help="SGLang server URL(s): measure the engine's routing against the trainer's",
    )
    p.add_argument(
        "--checkpoint", help="with --engine: HF model directory or moe-rl checkpoint (step_N/) the trainer's side loads"
    )
    p.add_argument("--prompts", help='JSONL, one {"prompt": "text"} or {"prompt": [ids]} / {"input_ids": [ids]} a line')
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", help="tokenizer directory for text prompts (default: --a or --checkpoint)")
    p.add_argument("--max-prompts", type=int, default=None)
    g = p.add_argument_group("with --engine")
    g.add_argument("--samples", type=int, default=1, help="samples per prompt")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (log-probs are at it)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument(
        "--sync-weights",
        action="store_true",
        help="load --checkpoint into the engine first (a path the server can read)",
    )
    g.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the servers to be healthy")
    add_layout_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_rl.commands._distributed import LayoutError, fail, maybe_spawn

    try:
        engine_mode = _check_mode(args)
        if not engine_mode:
            return _run(args)
        spawned = maybe_spawn(args, "drift")
        if spawned is not None:
            return spawned
        from moe_rl.commands.drift_engine import run_rank

        return run_rank(args)
    except (LayoutError, ValueError, FileNotFoundError, OSError) as e:
        return fail(str(e))


def _check_mode(args: argparse.Namespace) -> bool:
    """True for ``--engine`` mode; ``ValueError`` for a mix of the two modes or bad numbers."""
    pair = args.a is not None or args.b is not None
    engine = args.engine is not None or args.checkpoint is not None
    if pair == engine:
        raise ValueError("give either --a and --b (two checkpoints) or --engine and --checkpoint (engine vs trainer)")
    if pair:
        if args.a is None or args.b is None:
            raise ValueError("--a and --b go together")
        if args.nproc is not None or (args.tp, args.pp, args.ep, args.etp) != (1, 1, 1, None):
            raise ValueError(
                "--tp/--pp/--ep/--etp/--nproc apply to --engine mode (--a/--b runs transformers in one process)"
            )
        return False
    if args.engine is None or args.checkpoint is None or args.prompts is None:
        raise ValueError("--engine needs --checkpoint and --prompts")
    from moe_rl.commands.export import model_dir_of

    model_dir_of(args.checkpoint)
    if not Path(args.prompts).is_file():
        raise ValueError(f"--prompts {args.prompts}: no such file")
    bad = {
        "--samples": args.samples,
        "--max-new-tokens": args.max_new_tokens,
        "--micro-batch-size": args.micro_batch_size,
    }
    for flag, value in bad.items():
        if value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")
    if not args.temperature > 0:
        raise ValueError(f"--temperature={args.temperature} must be > 0")
    for url in args.engine:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine {url}: a URL needs http:// or https://")
    return True


def _is_routing_file(path: str) -> bool:
    return Path(path).is_file() and path.endswith(".safetensors")


def _tokenizer_of(args: argparse.Namespace) -> str:
    """Where text prompts are tokenized: ``--tokenizer``, else the first model's HF
    directory (a training checkpoint's ``model/``: the step directory has no tokenizer)."""
    from moe_rl.commands.export import model_dir_of

    if args.tokenizer:
        return args.tokenizer
    return str(model_dir_of(args.b if _is_routing_file(args.a) else args.a))


def _run(args: argparse.Namespace) -> int:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from moe_rl.commands.prompt_file import read_prompts
    from moe_rl.routing.drift import drift_metrics, load_metrics, summarize
    from moe_rl.routing.tensorboard import heatmap_figure, log_routing

    needs_prompts = not (_is_routing_file(args.a) and _is_routing_file(args.b))
    prompts = read_prompts(args.prompts, _tokenizer_of(args), args.max_prompts) if needs_prompts else None
    a, b = _routing_of(args.a, prompts), _routing_of(args.b, prompts)
    if a["indices"].shape != b["indices"].shape or not torch.equal(a["layers"], b["layers"]):
        raise ValueError(
            f"the two routings cover different tokens or layers: {tuple(a['indices'].shape)} layers "
            f"{a['layers'].tolist()} vs {tuple(b['indices'].shape)} layers {b['layers'].tolist()}"
        )
    mask = a["mask"] * b["mask"]
    probs = dict(probs_a=a.get("probs"), probs_b=b.get("probs")) if "probs" in a and "probs" in b else {}
    metrics = drift_metrics(a["indices"], b["indices"], mask=mask, **probs)
    num_experts = _num_experts(args, a, b)
    load_a = load_metrics(a["indices"], num_experts, mask)
    load_b = load_metrics(b["indices"], num_experts, mask)
    layers = a["layers"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "a": args.a,
        "b": args.b,
        "tokens": int(mask.sum()),
        "layers": layers.tolist(),
        "metrics": summarize(metrics),
        "expert_load_a": summarize(load_a),
        "expert_load_b": summarize(load_b),
    }
    (out / "drift.json").write_text(json.dumps(report, indent=2))
    with SummaryWriter(str(out / "tensorboard")) as writer:
        log_routing(writer, 0, {**metrics, "drift_layers": layers, **load_b, "load_layers": layers})
    fig = heatmap_figure(
        load_a["expert_load"],
        layers.tolist(),
        panels={"a: expert load": load_a["expert_load"], "b: expert load": load_b["expert_load"]},
    )
    fig.savefig(out / "expert_load_heatmap.png", dpi=100)
    print(
        f"routing drift over {report['tokens']} tokens, {len(layers)} MoE layers: "
        f"changed_frac {report['metrics']['changed_frac']['mean']:.4f}, "
        f"expert_change_frac {report['metrics']['expert_change_frac']['mean']:.4f}, "
        f"any_layer_changed_frac {report['metrics']['any_layer_changed_frac']['mean']:.4f}"
        + (f", router_kl {report['metrics']['router_kl']['mean']:.3e}" if "router_kl" in report["metrics"] else "")
        + f" -> {out / 'drift.json'}"
    )
    return 0


def _num_experts(args: argparse.Namespace, a: dict, b: dict) -> int:
    """The model's expert count: the router distributions' size, what the routing files
    record, or ``--num-experts``; all that are known must agree. Never the largest index:
    an expert no token chose would vanish from the load and its imbalance."""
    known = {n for n in (a.get("num_experts"), b.get("num_experts"), args.num_experts) if n is not None}
    if len(known) > 1:
        raise ValueError(f"the expert counts disagree: {sorted(known)} (routing files, models and --num-experts)")
    if not known:
        raise ValueError("the routing files record no expert count: pass --num-experts (the model's experts)")
    return known.pop()


def _routing_of(path: str, prompts: list[list[int]] | None) -> dict:
    import torch

    from moe_rl.routing.encoding import load_routing, routing_num_experts

    if _is_routing_file(path):
        routing: dict = load_routing(path)
        routing.setdefault("mask", torch.ones(routing["indices"].shape[0], dtype=torch.uint8))
        routing.setdefault("layers", torch.arange(routing["indices"].shape[1]))
        routing["num_experts"] = routing_num_experts(path)
        if "probs" in routing:
            routing["num_experts"] = routing["probs"].shape[-1]
        return routing
    from transformers import AutoModelForCausalLM

    from moe_rl.models.architectures import architecture_of
    from moe_rl.routing.hf_routing import transformers_routing

    from moe_rl.commands.export import model_dir_of

    if prompts is None:
        raise ValueError(f"--prompts is needed to route {path} (a model, not a routing file)")
    path = str(model_dir_of(path))  # a training checkpoint's model/, verified first
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    vocab = model.config.vocab_size
    arch = architecture_of(model.config)
    layers = torch.tensor([l for l, moe in enumerate(arch.moe_layer_pattern(model.config)) if moe])
    indices, probs = [], []
    for ids in prompts:
        if max(ids) >= vocab:
            raise ValueError(f"prompt token id {max(ids)} is outside the vocabulary of {path} ({vocab})")
        idx, pr = transformers_routing(model, torch.tensor([ids]))
        indices.append(idx[0][:, layers])
        probs.append(pr[0][:, layers])
    indices_t = torch.cat(indices)
    return {
        "indices": indices_t,
        "probs": torch.cat(probs),
        "mask": torch.ones(indices_t.shape[0]),
        "layers": layers,
        "num_experts": arch.num_experts(model.config),
    }
