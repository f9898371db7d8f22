"""Process groups from the launcher's environment, and megatron-core's parallel state.

The DeepSpeed launcher and torchrun both set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT. CUDA machines use one device per local rank and a process group with
both backends (``cpu:gloo,cuda:nccl``); CPU machines use gloo and install the CPU bridge
(:mod:`parallel.cpu_bridge`) first.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.layout import LayoutError, ModelDims, ParallelLayout
from parallel.peer_failure import start_peer_watch, stop_peer_watch


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_env() -> LaunchEnv:
    """Read the launcher's variables; a plain ``python`` start is a world of one."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        port: str | int | None = os.environ.get("MASTER_PORT")
        if port is None:
            # a plain one-process start: any free port, so that concurrent runs never collide
            from parallel.launch import free_port

            port = free_port() if world_size == 1 else 29500
        return LaunchEnv(
            rank=int(os.environ.get("RANK", 0)),
            world_size=world_size,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(port),
        )
    except ValueError as e:
        raise LayoutError(f"bad launcher environment (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT): {e}") from None


def node_gpu_ids() -> list[str]:
    """The GPUs this node's ranks use, as ``CUDA_VISIBLE_DEVICES`` names them (local rank i
    takes the i-th visible device); empty without CUDA. Readable before any group exists."""
    if not torch.cuda.is_available():
        return []
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)  # torchrun | DeepSpeed
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = (
        [x.strip() for x in visible.split(",") if x.strip()]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    return names[:local]


# Set (unless the user did) before CUDA and NCCL start: megatron's recommendation for TP
# communication overlap (must precede CUDA init); and NCCL without cuMem allocations, as
# SGLang sets it in its own processes: the weight-update group spans trainer and servers on
# one node, and NCCL peers with different cuMem settings fail or hang (slime sets it too).
COMMUNICATION_ENVIRONMENT = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_CUMEM_ENABLE": "0"}


def process_group_backend(use_cuda: bool) -> str:
    """NCCL for CUDA tensors with gloo beside it for CPU tensors (a stray CPU collective
    works instead of failing), or gloo alone on CPU machines."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def init_distributed(
    layout: ParallelLayout,
    model: ModelDims | None = None,
    *,
    seed: int = 1234,
    timeout_minutes: float = 180.0,
) -> LaunchEnv:
    """Validate ``layout``, create the process group and megatron's parallel groups.
    ``timeout_minutes``: how long a collective may wait (non-first ranks wait in one for
    the whole rollout and evaluation) before the watchdog ends the run."""
    env = launch_env()
    layout.validate(env.world_size, model)  # before any group exists
    use_cuda = torch.cuda.is_available()
    for name, value in COMMUNICATION_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if not use_cuda:
        from parallel import cpu_bridge

        cpu_bridge.install()
    else:
        torch.cuda.set_device(env.local_rank)
    from parallel import megatron_compat

    megatron_compat.install()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(
            backend=process_group_backend(use_cuda),
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
        # one rank's failure stops the others, which may be waiting for it in a collective
        start_peer_watch(env.rank, env.world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        distributed_timeout_minutes=timeout_minutes,
    )
    model_parallel_cuda_manual_seed(seed)
    return env


def destroy_distributed() -> None:
    """Tear down megatron's groups and the process group (safe to call twice); a rank that
    announced its failure (:func:`parallel.peer_failure.announce_failure`) first waits for
    the others to see it."""
    stop_peer_watch()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
