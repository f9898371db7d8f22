"""``moe-rl drift``: routing drift between two checkpoints (or two saved routings) on a
prompt set: ``drift.json``, TensorBoard events and a PNG heatmap."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "routing drift between two HF checkpoints or routing files on a prompt set"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drift", help=HELP, description=HELP)
    p.add_argument("--a", required=True, help="HF model directory, or a routing file (.safetensors) saved by training")
    p.add_argument("--b", required=True, help="the same, to compare with --a")
    p.add_argument("--prompts", help='JSONL, one {"prompt": "text"} or {"prompt": [ids]} / {"input_ids": [ids]} a line')
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", help="tokenizer directory for text prompts (default: --a)")
    p.add_argument("--max-prompts", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_rl.commands._distributed import fail

    try:
        return _run(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        return fail(str(e))


def _is_routing_file(path: str) -> bool:
    return Path(path).is_file() and path.endswith(".safetensors")


def _run(args: argparse.Namespace) -> int:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from moe_rl.routing.drift import drift_metrics, load_metrics, summarize
    from moe_rl.routing.tensorboard import heatmap_figure, log_routing

    needs_prompts = not (_is_routing_file(args.a) and _is_routing_file(args.b))
    prompts = _read_prompts(args.prompts, args.tokenizer or args.a, args.max_prompts) if needs_prompts else None
    a, b = _routing_of(args.a, prompts), _routing_of(args.b, prompts)
    if a["indices"].shape != b["indices"].shape or not torch.equal(a["layers"], b["layers"]):
        raise ValueError(
            f"the two routings cover different tokens or layers: {tuple(a['indices'].shape)} layers "
            f"{a['layers'].tolist()} vs {tuple(b['indices'].shape)} layers {b['layers'].tolist()}"
        )
    mask = a["mask"] * b["mask"]
    probs = dict(probs_a=a.get("probs"), probs_b=b.get("probs")) if "probs" in a and "probs" in b else {}
    metrics = drift_metrics(a["indices"], b["indices"], mask=mask, **probs)
    num_experts = a["probs"].shape[-1] if "probs" in a else int(max(a["indices"].max(), b["indices"].max())) + 1
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


def _read_prompts(path: str | None, tokenizer_dir: str, limit: int | None) -> list[list[int]]:
    if path is None:
        raise ValueError("--prompts is needed when --a or --b is a model directory")
    prompts: list[list[int]] = []
    tokenizer = None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            value = record.get("input_ids", record.get("prompt")) if isinstance(record, dict) else None
            if isinstance(value, str):
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
                value = tokenizer(value)["input_ids"]
            if not isinstance(value, list) or not value or not all(isinstance(t, int) for t in value):
                raise ValueError(f'{path}:{line_no}: needs "prompt" (text or token ids) or "input_ids"')
            prompts.append(value)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def _routing_of(path: str, prompts: list[list[int]] | None) -> dict:
    import torch

    from moe_rl.routing.encoding import load_routing

    if _is_routing_file(path):
        routing = load_routing(path)
        routing.setdefault("mask", torch.ones(routing["indices"].shape[0], dtype=torch.uint8))
        routing.setdefault("layers", torch.arange(routing["indices"].shape[1]))
        return {k: v for k, v in routing.items()}
    from transformers import AutoModelForCausalLM

    from moe_rl.models.architectures import architecture_of
    from moe_rl.routing.hf_routing import transformers_routing

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
    return {"indices": indices_t, "probs": torch.cat(probs), "mask": torch.ones(indices_t.shape[0]), "layers": layers}
