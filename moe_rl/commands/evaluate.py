"""``moe-rl eval --checkpoint CKPT --task SPEC``: a checkpoint on held-out problems, as the
trainer evaluates during a run (``data.eval_*`` settings): pass@1, pass@k and the mean
rewards, with a progress bar; ``--out`` keeps ``eval.json`` and TensorBoard events.

The prompt format, rewards and sampling come from ``--config``, else from the config the
checkpoint's run wrote (``<run>/config.yaml``), else the built-in defaults; dotted
overrides apply on top. Responses come from the local engine, or from SGLang servers
(``--engine URL...``) that serve the checkpoint (``--sync-weights`` loads it into them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "evaluate a checkpoint on held-out problems: pass@1, pass@k, mean reward"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help=HELP, description=HELP)
    p.add_argument(
        "--checkpoint", required=True, help="a training checkpoint (step_N/) or a Hugging Face model directory"
    )
    p.add_argument(
        "--task",
        help="held-out problems: arithmetic, .jsonl/.json/.parquet, or a datasets DIR[:split] (default: the"
        " run config's data.eval_task)",
    )
    p.add_argument(
        "--config", help="run config for the prompt format, rewards and sampling (default: the checkpoint's run's)"
    )
    p.add_argument("--engine", nargs="+", metavar="URL", help="SGLang server URL(s) (default: the local engine)")
    p.add_argument(
        "--sync-weights", action="store_true", help="with --engine: load the checkpoint into the servers first"
    )
    p.add_argument(
        "--wait-s", type=float, default=300.0, help="with --engine: how long to wait for the servers to be healthy"
    )
    p.add_argument("--out", help="directory for eval.json and TensorBoard events")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. data.eval_samples=8")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_rl.checkpoint.run_dir import live_run_holding
    from moe_rl.commands import configure_logging
    from moe_rl.commands._distributed import fail
    from moe_rl.commands.export import model_dir_of
    from moe_rl.config import ConfigError
    from moe_rl.rollout.types import RolloutError

    configure_logging()
    problem = _arguments_problem(args)
    if problem:
        return fail(problem)
    live = live_run_holding(args.out) if args.out else None
    if live:
        return fail(
            f"--out {args.out!r} is inside a live run's directory ({live[0]}, held by {live[1]}): choose another"
        )
    try:
        model_dir = model_dir_of(args.checkpoint)
        cfg = _config(args)
        if cfg.data.eval_task is None:
            return fail("no held-out problems: give --task (or data.eval_task=...)")
        scalars = _evaluate(args, cfg, model_dir)
    except ConfigError as e:
        return fail(str(e))
    except (ValueError, OSError, RolloutError) as e:
        return fail(f"eval: {e}")
    _report(args, cfg, model_dir, scalars)
    return 0


def _arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--engine`` or ``--out``, found before anything is evaluated."""
    from moe_rl.rollout.settings import is_server_url

    for url in args.engine or []:
        if "=" in url:
            return f"--engine took the override {url!r} for a server URL: give overrides before --engine"
        if not is_server_url(url):
            return f"--engine {url!r} must be a URL like http://host:30000"
    if not args.wait_s > 0:
        return f"--wait-s {args.wait_s:g} must be > 0"
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        return f"--out {args.out!r} is a file: it must be a directory (eval.json and TensorBoard events go there)"
    return None


def _config(args: argparse.Namespace):
    """``--config``, else the checkpoint's run's ``config.yaml``, else defaults; then overrides."""
    from moe_rl.config import load_config

    path = args.config
    if path is None:
        path = _run_config(Path(args.checkpoint).resolve())
    overrides = list(args.overrides) + ([f"data.eval_task={args.task}"] if args.task else [])
    return load_config(path, overrides)


def _run_config(checkpoint: Path) -> str | None:
    """The ``config.yaml`` of the run a checkpoint (``<run>/checkpoints/step_N``) or its
    weights (``step_N/model``) belong to; ``None`` for a model directory of no run."""
    for step in (checkpoint, checkpoint.parent):
        if step.parent.name == "checkpoints" and (step.parent.parent / "config.yaml").is_file():
            return str(step.parent.parent / "config.yaml")
    return None


def _evaluate(args: argparse.Namespace, cfg, model_dir: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    from moe_rl.data.tasks import make_task
    from moe_rl.experience.evaluation import build_evaluator
    from moe_rl.experience.builders import build_sampler, build_scorer

    d = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    formatter = d.prompt_formatter(tokenizer)
    task = make_task(d.eval_task, d.max_operand, d.prompt_key, d.answer_key, d.held_out)
    engine = _engine(args, cfg, model_dir)
    try:
        evaluator = build_evaluator(
            cfg,
            task,
            formatter,
            build_sampler(cfg.rollout.multi_turn, engine, tokenizer),
            build_scorer(cfg),
            progress=sys.stderr.isatty(),
        )
        return evaluator.run(desc=f"eval {model_dir.parent.name if model_dir.name == 'model' else model_dir.name}")
    finally:
        engine.close()


def _engine(args: argparse.Namespace, cfg, model_dir: Path):
    """The local engine on the checkpoint, or the SGLang servers (synced when asked)."""
    import torch

    from moe_rl.models.architectures import architecture_of, load_hf_config

    if not args.engine:
        from moe_rl.rollout.local import LocalEngine

        return LocalEngine(str(model_dir), weight_precision=torch.bfloat16 if cfg.rollout.precision == "bf16" else None)
    from moe_rl.rollout.sglang.engine import SGLangEngine

    hf_config = load_hf_config(str(model_dir))
    engine = SGLangEngine(
        args.engine,
        num_layers=hf_config.num_hidden_layers,
        top_k=hf_config.num_experts_per_tok,
        num_experts=architecture_of(hf_config).num_experts(hf_config),
    )
    engine.wait_healthy(timeout_s=args.wait_s)
    if args.sync_weights:
        engine.update_weights_from_disk(str(model_dir.resolve()), "moe-rl-eval")
    return engine


def _report(args: argparse.Namespace, cfg, model_dir: Path, scalars: dict[str, float]) -> None:
    """A table on stdout; ``eval.json`` and TensorBoard events in ``--out``."""
    width = max(map(len, scalars))
    print(f"{cfg.data.eval_task}  ({model_dir})")
    for tag, value in scalars.items():
        print(f"  {tag:<{width}}  {value:.4f}")
    if args.out:
        from torch.utils.tensorboard import SummaryWriter

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "checkpoint": str(args.checkpoint),
            "task": cfg.data.eval_task,
            "samples": cfg.data.eval_samples,
            "scalars": scalars,
        }
        (out / "eval.json").write_text(json.dumps(record, indent=2) + "\n")
        with SummaryWriter(str(out / "tensorboard")) as writer:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, 0)
