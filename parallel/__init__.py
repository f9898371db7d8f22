"""Model-parallel plumbing: layout validation, process groups, megatron-core parallel
state, and the CPU bridge (loaded only on machines without CUDA)."""

from parallel.layout import LayoutError, ModelDims, ParallelLayout

__all__ = ["LayoutError", "ModelDims", "ParallelLayout"]
