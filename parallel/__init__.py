"""Model-parallel plumbing: process groups, megatron-core parallel state, the CPU bridge.

(Filled in by the model-backend issue; kept importable so the package layout is stable.)
"""
