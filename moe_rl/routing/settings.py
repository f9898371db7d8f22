"""The ``routing`` config section: replay (R2/R3), expert-bias balancing, drift metrics, recompute."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.checks import ConfigError, require_choice, require_positive
from moe_rl.routing.modes import REPLAY_MODES


@dataclass
class RoutingConfig:
    replay: str = "none"  # none | r2 | r3
    # routers with an expert bias (GLM-4.5, DeepSeek-V3): aux-loss-free balancing step; 0 freezes it
    expert_bias_update_rate: float = 1e-3
    metrics: bool = True  # drift metrics; also asks the rollout engine for routed experts (train-inference drift)
    # one extra forward to measure the routing an update changes (and router_kl, the only metric that keeps router distributions)
    after_update_pass: bool = True
    # share of each micro-batch's tokens the drift metrics observe (a seeded draw; counts scaled to all tokens): < 1 for huge batches
    metrics_sample_frac: float = 1.0
    recompute_activations: bool = False  # recompute MoE layers in the backward (R2/R3 replay the same routing there)

    def validate(self) -> None:
        require_choice("routing.replay", self.replay, REPLAY_MODES)
        require_positive("routing.expert_bias_update_rate", self.expert_bias_update_rate, allow_zero=True)
        if not 0 < self.metrics_sample_frac <= 1:
            raise ConfigError(f"routing.metrics_sample_frac={self.metrics_sample_frac} must be in (0, 1]")
