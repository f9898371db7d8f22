"""RL algorithm core: advantage estimators and policy losses, selected by name.

>>> compute_advantages("gdpo", rewards, group_size=8, weights=[1.0, 0.5])
>>> loss, metrics = policy_loss("gspo", logp, old_logp, advantages, mask)
"""

from moe_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from moe_rl.algorithms.aggregation import AGG_MODES, aggregate, masked_mean, sequence_mean
from moe_rl.algorithms.kl import (
    KL_ESTIMATORS,
    entropy_bonus,
    entropy_from_logits,
    kl_divergence,
    kl_penalty,
)
from moe_rl.algorithms.losses import POLICY_LOSSES, loss_defaults, policy_loss
from moe_rl.algorithms.reward_shaping import conditional_reward

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "aggregate",
    "compute_advantages",
    "conditional_reward",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_divergence",
    "kl_penalty",
    "loss_defaults",
    "masked_mean",
    "policy_loss",
    "sequence_mean",
]
