"""The ``algorithm`` config section: advantage, loss, old log-probs, rollout correction, KL,
updates and micro-batching; every choice name is read from its registry."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_rl.checks import ConfigError, require_choice, require_positive

OLD_LOGPROBS = ("recompute", "rollout")  # the trainer's old-policy pass | the engine's log-probs
REFERENCES = ("host", "device")  # where the KL reference policy lives


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | gdpo (moe_rl.algorithms.advantages)
    loss: str = "grpo"  # grpo | gspo | gspo_token | gmpo | gmpo_seqclip | cispo | sapo (moe_rl.algorithms.losses)
    loss_params: dict = field(default_factory=dict)  # the loss's parameters, e.g. {eps_low: 0.2, eps_high: 0.28}
    old_logprobs: str = "recompute"  # recompute | rollout (the engine's: the mismatch folded into the ratio)
    # train-inference mismatch correction (moe_rl.algorithms.rollout_correction): none |
    # token_tis | seq_tis | token_mis | icepop | token_band_reject | seq_mis | reject, with its parameters
    rollout_correction: str = "none"
    rollout_correction_params: dict = field(default_factory=dict)  # its parameters, e.g. {upper: 2.0}
    kl_coef: float = 0.0  # KL to the reference (starting) policy; 0: off
    reference: str = "host"  # KL reference: host (starting weights swapped into the policy) | device (a second model)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0  # entropy bonus
    updates_per_batch: int = 2  # optimizer steps on each step's samples
    micro_batch_size: int = 32  # rows per micro-batch (with a token budget: at most)
    # samples packed by length into micro-batches of at most this many padded tokens (rows x
    # longest), data-parallel ranks balanced by tokens; -1: derived each step, micro_batch_size
    # x the step's mean sample length; 0: micro_batch_size rows in sample order. Every
    # micro-batch is padded only to its own longest sample
    max_tokens_per_micro_batch: int = -1

    @property
    def corrects_rollout(self) -> bool:
        """Whether a rollout correction weighs (and may drop) tokens."""
        return self.rollout_correction != "none"

    def validate(self, group_size: int) -> None:
        """``group_size``: the rollout's responses per prompt (advantages need >= 2)."""
        from moe_rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
        from moe_rl.algorithms.losses import check_loss_params

        require_choice("algorithm.advantage", self.advantage, ADVANTAGE_ESTIMATORS.names())
        require_choice("algorithm.loss", self.loss, POLICY_LOSSES.names())
        try:
            check_loss_params(self.loss, self.loss_params, configurable_only=True)
        except ValueError as e:
            raise ConfigError(f"algorithm.loss_params.{e}") from None
        require_choice("algorithm.old_logprobs", self.old_logprobs, OLD_LOGPROBS)
        self._validate_rollout_correction()
        require_choice("algorithm.reference", self.reference, REFERENCES)
        require_choice("algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS.names())
        require_positive("algorithm.kl_coef", self.kl_coef, allow_zero=True)
        require_positive("algorithm.entropy_coef", self.entropy_coef, allow_zero=True)
        require_positive("algorithm.updates_per_batch", self.updates_per_batch)
        require_positive("algorithm.micro_batch_size", self.micro_batch_size)
        if self.max_tokens_per_micro_batch < -1:
            raise ConfigError(
                f"algorithm.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be -1 (derived), 0 (by rows) or a token budget > 0"
            )
        if group_size < 2:  # every estimator's baseline is its group's: a lone sample's advantage is 0
            raise ConfigError(
                f"rollout.group_size={group_size} must be >= 2 for algorithm.advantage={self.advantage!r}"
            )

    def _validate_rollout_correction(self) -> None:
        from moe_rl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, check_correction_params

        require_choice("algorithm.rollout_correction", self.rollout_correction, ["none", *ROLLOUT_CORRECTIONS.names()])
        if not self.corrects_rollout:
            if self.rollout_correction_params:
                raise ConfigError(
                    "algorithm.rollout_correction_params are set but algorithm.rollout_correction is none"
                )
            return
        if self.old_logprobs == "rollout":
            raise ConfigError(
                f"algorithm.rollout_correction={self.rollout_correction!r} weighs the trainer's recomputed old log-probs "
                "against the engine's; with algorithm.old_logprobs=rollout the ratio is already taken against the "
                "engine's (the correction is folded in): use one or the other"
            )
        try:
            check_correction_params(self.rollout_correction, self.rollout_correction_params)
        except ValueError as e:
            raise ConfigError(f"algorithm.rollout_correction_params.{e}") from None
