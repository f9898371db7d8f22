"""The ``reward`` config section: named rewards with weights, conditional rewards, how calls run."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_rl.checks import ConfigError, require_positive


@dataclass
class RewardItem:
    name: str = ""
    fn: str = ""
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)


@dataclass
class ConditionalItem:
    target: str = ""
    condition: str = ""
    threshold: float = 1.0


@dataclass
class RewardConfig:
    # named rewards (fn: a built-in rule or module:function), summed with their weights
    # (GDPO: normalised apart); the defaults suit the built-in a+b= task
    rewards: list[RewardItem] = field(
        default_factory=lambda: [
            RewardItem("correct", "math_correct", 1.0),
            RewardItem("format", "format", 0.5),
            RewardItem("short", "length", 0.25, {"budget": 4}),
        ]
    )
    # target pays only where condition >= threshold
    conditionals: list[ConditionalItem] = field(default_factory=lambda: [ConditionalItem("short", "correct", 1.0)])
    timeout_s: float = 5.0  # a reward call past this scores 0 (counted in reward/failures/<name>)
    # 0: each call in a thread of the first rank, one at a time; N: N worker processes in
    # parallel, a call past timeout_s has its worker killed (nothing left running)
    workers: int = 0
    # the response text rewards score (and samples.jsonl shows) keeps the tokenizer's special
    # tokens (chat and tool markers, EOS excepted); default: decoded with them skipped, as
    # TRL, verl and SGLang's own text give it
    keep_special_tokens: bool = False
    # score each group (a prompt's group_size responses) as soon as its last response is
    # done, in the background while the rest still generate; the step then waits only for
    # the rewards still left. Same rewards and advantages as scoring after the whole batch
    # (advantages still wait for every group); off: everything scored after generation
    score_as_finished: bool = False

    def validate(self) -> None:
        from moe_rl.rewards import check_reward_function

        names = [item.name for item in self.rewards]
        if not names:
            raise ConfigError("reward.rewards is empty; give at least one reward")
        for i, item in enumerate(self.rewards):
            if not item.name:
                raise ConfigError(f"reward.rewards[{i}].name is empty")
            try:
                check_reward_function(item.fn, item.kwargs)
            except ValueError as e:
                raise ConfigError(f"reward.rewards[{i}].fn={item.fn!r} {e}") from None
        if len(set(names)) != len(names):
            raise ConfigError(f"reward.rewards names must be unique, got {names}")
        for i, cond in enumerate(self.conditionals):
            for attr in ("target", "condition"):
                if getattr(cond, attr) not in names:
                    raise ConfigError(
                        f"reward.conditionals[{i}].{attr}={getattr(cond, attr)!r} is not a reward; rewards: {', '.join(names)}"
                        " (new reward.rewards keep the default conditionals: set reward.conditionals=[] or new ones)"
                    )
        require_positive("reward.timeout_s", self.timeout_s)
        require_positive("reward.workers", self.workers, allow_zero=True)
