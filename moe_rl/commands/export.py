"""``moe-rl export``: a checkpoint's weights, through the megatron model, to a Hugging
Face directory (safetensors shards, index, config, tokenizer files)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "export a checkpoint (HF-layout model weights) to a Hugging Face directory"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from moe_rl.commands._distributed import add_layout_args

    p = sub.add_parser("export", help=HELP, description=HELP)
    p.add_argument("--checkpoint", required=True, help="a training checkpoint directory or a HF model directory")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: the config's")
    add_layout_args(p)
    p.set_defaults(func=run)


def model_dir_of(checkpoint: str) -> Path:
    """A training checkpoint keeps its weights in ``model/``; a HF directory is itself."""
    path = Path(checkpoint)
    if (path / "model" / "config.json").exists():
        return path / "model"
    if (path / "config.json").exists():
        return path
    raise FileNotFoundError(f"{checkpoint} is not a Hugging Face model directory or a moe-rl checkpoint (no config.json in it or in model/)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.commands._distributed import LayoutError, fail, maybe_spawn
    from moe_rl.models.export_dir import export_destination_problem

    problem = export_destination_problem(args.out)
    if problem:
        return fail(f"--out {problem}")
    try:
        spawned = maybe_spawn(args, "export")
        if spawned is not None:
            return spawned
        return _run_rank(args)
    except (LayoutError, ValueError, FileNotFoundError) as e:
        return fail(str(e))


def _run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from moe_rl.commands._distributed import layout_from
    from moe_rl.models.architectures import load_hf_config, model_dims
    from moe_rl.models.builder import build_model, make_transformer_config
    from moe_rl.models.hf_weights import SafetensorsDir, export_hf_weights, load_hf_weights
    from parallel.distributed import destroy_distributed, init_distributed

    src = model_dir_of(args.checkpoint)
    hf_config = load_hf_config(str(src))
    layout = layout_from(args)
    source_dtype = SafetensorsDir(src).dtype()
    init_distributed(layout, model_dims(hf_config))
    try:
        # hold the weights in the checkpoint's own precision so the export is exact
        config = make_transformer_config(hf_config, layout, params_dtype=torch.float32 if source_dtype == torch.float32 else source_dtype)
        model = build_model(hf_config, config)
        load_hf_weights(model, hf_config, src)
        dtype = getattr(torch, args.dtype) if args.dtype else source_dtype
        out = export_hf_weights(model, hf_config, args.out, dtype=dtype, copy_files_from=src)
        if dist.get_rank() == 0:
            print(f"exported {src} -> {out} ({str(dtype).removeprefix('torch.')})")
        return 0
    finally:
        destroy_distributed()
