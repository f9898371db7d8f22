"""Model-parallel plumbing: layout validation, process groups, megatron-core parallel
state, and the CPU bridge (loaded only on machines without CUDA)."""

from parallel.fusers import run_megatron_fusers_eagerly_on_cpu_builds
from parallel.layout import LayoutError, ModelDims, ParallelLayout

run_megatron_fusers_eagerly_on_cpu_builds()

__all__ = ["LayoutError", "ModelDims", "ParallelLayout"]
