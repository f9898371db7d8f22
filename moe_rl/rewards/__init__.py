"""Rule rewards and the multi-reward scorer (named columns for GDPO)."""

from moe_rl.rewards import rules  # noqa: F401  (registers the built-in rewards)
from moe_rl.rewards.base import (
    FAILURE_KINDS,
    REWARD_FUNCTIONS,
    ConditionalSpec,
    RewardBatch,
    RewardInput,
    RewardSpec,
    check_reward_function,
    resolve_reward_fn,
)
from moe_rl.rewards.scorer import RewardScorer

__all__ = [
    "FAILURE_KINDS",
    "REWARD_FUNCTIONS",
    "ConditionalSpec",
    "RewardBatch",
    "RewardInput",
    "RewardScorer",
    "RewardSpec",
    "check_reward_function",
    "resolve_reward_fn",
]
