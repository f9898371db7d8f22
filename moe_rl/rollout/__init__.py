"""Rollout engines: SGLang servers over HTTP, or the built-in local engine."""

from moe_rl.rollout.types import RolloutEngine, RolloutError, Sample, SamplingParams, StaleWeightsError

__all__ = ["RolloutEngine", "RolloutError", "Sample", "SamplingParams", "StaleWeightsError"]
