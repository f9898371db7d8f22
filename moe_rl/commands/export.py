"""``moe-rl export``: a checkpoint's weights, through the megatron model, to a Hugging
Face directory (safetensors shards, index, config, tokenizer files). The checkpoint is a
training checkpoint (its sharded weights in ``dist/``, read under this command's layout
whatever layout wrote them, after the checks a resume makes: ``checkpoint/verify.py``) or a
Hugging Face directory."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "export a training checkpoint (or a HF directory) to a Hugging Face directory"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from moe_rl.commands._distributed import add_layout_args

    p = sub.add_parser("export", help=HELP, description=HELP)
    p.add_argument("--checkpoint", required=True, help="a training checkpoint directory or a HF model directory")
    p.add_argument(
        "--out", required=True, help="output directory: new, empty, or an earlier export (replaced atomically)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: the config's")
    add_layout_args(p)
    p.set_defaults(func=run)


def model_dir_of(checkpoint: str) -> Path:
    """The HF directory of a checkpoint: a training checkpoint's ``model/`` (the last
    step's, and every ``train.export_every`` steps'), verified against the checkpoint's
    manifest first (:class:`CheckpointMismatch` naming what is damaged), or a HF directory
    itself."""
    from moe_rl.checkpoint.catalog import CheckpointMismatch, model_problem

    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"{checkpoint} does not exist (a checkpoint step_N/ or a Hugging Face model directory)")
    if (path / "model" / "config.json").exists():
        problem = model_problem(path) if (path / "meta.json").exists() or (path / "dist").is_dir() else None
        if problem:
            raise CheckpointMismatch(
                f"checkpoint {path}'s model/ cannot be trusted: {problem} (write it again from the checkpoint's "
                f"training state: `moe-rl export --checkpoint {path} --out DIR`, and pass DIR)"
            )
        return path / "model"
    if (path / "config.json").exists():
        return path
    if (path / "dist").is_dir():
        raise FileNotFoundError(
            f"{checkpoint} holds no Hugging Face weights (model/): write them with "
            f"`moe-rl export --checkpoint {checkpoint} --out DIR` and pass DIR"
        )
    raise FileNotFoundError(
        f"{checkpoint} is not a Hugging Face model directory or a moe-rl checkpoint (no config.json in it or in model/)"
    )


def _source(checkpoint: str) -> tuple[Path, Path | None]:
    """Where the config and tokenizer files are, and the sharded checkpoint to read the
    weights from (``None``: the HF weights beside the config)."""
    path = Path(checkpoint)
    if (path / "dist").is_dir() and (path / "hf" / "config.json").is_file():
        return path / "hf", path
    return model_dir_of(checkpoint), None


def run(args: argparse.Namespace) -> int:
    from moe_rl.commands._distributed import LayoutError, fail, maybe_spawn
    from moe_rl.models.export_dir import export_destination_problem

    problem = export_destination_problem(args.out)
    if problem:
        return fail(f"--out: {problem}")
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
    from moe_rl.checkpoint.catalog import verify_checkpoint
    from moe_rl.checkpoint.store import load_weights, sharded_weights_dtype
    from parallel.distributed import destroy_distributed, init_distributed
    from parallel.peer_failure import announce_failure

    src, sharded = _source(args.checkpoint)
    hf_config = load_hf_config(str(src))
    layout = layout_from(args)
    source_dtype = sharded_weights_dtype(sharded) if sharded else SafetensorsDir(src).dtype()
    init_distributed(layout, model_dims(hf_config))
    try:
        # hold the weights in the checkpoint's own precision so the export is exact
        config = make_transformer_config(hf_config, layout, params_dtype=source_dtype)
        model = build_model(hf_config, config)
        if sharded:
            verify_checkpoint(sharded)
            load_weights(sharded, model)
        else:
            load_hf_weights(model, hf_config, src)
        dtype = getattr(torch, args.dtype) if args.dtype else source_dtype
        out = export_hf_weights(model, hf_config, args.out, dtype=dtype, copy_files_from=src)
        if dist.get_rank() == 0:
            print(f"exported {args.checkpoint} -> {out} ({str(dtype).removeprefix('torch.')})")
        return 0
    except BaseException as e:
        announce_failure(e)  # the other ranks may be waiting for this one
        raise
    finally:
        destroy_distributed()
