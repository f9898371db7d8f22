"""NCCL versions: a weight-update group over NCCL needs the same one on the trainer and every server."""

from __future__ import annotations

import logging

import torch

from moe_rl.rollout.types import RolloutError

log = logging.getLogger(__name__)


def trainer_nccl_version() -> str | None:
    """The NCCL this process's torch runs (``"2.27.7"``), ``None`` without one (no CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version() if part != "")
    except (AttributeError, RuntimeError):  # a torch built without NCCL
        return None


def check_nccl_versions(trainer: str | None, servers: dict[str, str | None]) -> None:
    """A weight-update group over NCCL needs one NCCL version on every rank (NCCL refuses a
    peer of another: "Mismatched NCCL version detected"): a :class:`RolloutError` naming
    both and the fix where a server's differs; a warning for those whose version is unknown."""
    unknown = [url for url, version in servers.items() if version is None]
    if unknown:
        log.warning(
            "cannot check the NCCL version of SGLang server(s) %s (SGLang does not report it; moe-rl asks the servers "
            "it starts): they must run NCCL %s, the trainer's, or the first weight update fails",
            unknown,
            trainer or "(unknown)",
        )
    for url, version in servers.items():
        if version is not None and version != trainer:
            raise RolloutError(
                f"the trainer runs NCCL {trainer or '(none)'} and the SGLang server {url} NCCL {version or '(none)'}: a "
                "weight-update group needs one NCCL on both sides (install both on one torch: bash tools/setup.sh "
                "--sglang, docs/weight-sync.md), or use rollout.weight_sync.method=disk"
            )
