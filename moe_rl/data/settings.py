"""The ``data`` config section: where problems come from, how prompts are made, held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_rl.checks import ConfigError, require_positive
from moe_rl.data.prompts import PromptFormatter, check_prompt_settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class DataConfig:
    # a built-in task (arithmetic | arithmetic_chain), or a dataset: .jsonl/.json/.parquet file, datasets dir (DIR[:split])
    task: str = "arithmetic"
    prompt_key: str = "prompt"  # a dataset's prompt field (dots reach nested fields); text or chat messages
    answer_key: str = "answer"  # its reference-answer field, e.g. reward_model.ground_truth
    prompt_template: str = "{prompt}"  # wraps the question, e.g. "{prompt} Put the answer in \\boxed{}."
    chat_template: bool = False  # apply the tokenizer's chat template (with the generation prompt)
    system_prompt: str = ""  # with chat_template: a system message before each prompt
    max_operand: int = 9  # the built-in tasks: largest operand
    # the built-in tasks: this many distinct problems set aside (a fixed seeded choice) as the
    # evaluation's, never drawn for training nor the built-in model's warm start (0: evaluation
    # draws problems as training does)
    held_out: int = 0
    max_prompt_tokens: int = 64  # longer prompts are left-truncated (counted)
    eval_task: str | None = None  # held-out problems (same forms as task); evaluated every train.eval_every steps
    eval_max_prompts: int = 0  # 0: every problem (the built-in task: 64)
    eval_samples: int = 4  # responses per prompt: pass@1 and pass@<eval_samples>
    eval_temperature: float = 1.0  # sampling temperature of the evaluation
    eval_solved_reward: str = "correct"  # a reward: a response solves its problem when it scores >= 1

    def validate(self, reward_names: list[str]) -> None:
        """``reward_names``: the run's rewards (``eval_solved_reward`` must be one)."""
        from moe_rl.data.tasks import BUILT_IN_TASKS, resolve_spec

        for key in ("task", "eval_task"):
            spec = getattr(self, key)
            if spec is not None and spec not in BUILT_IN_TASKS:
                try:
                    resolve_spec(spec)
                except ValueError as e:
                    raise ConfigError(f"data.{key}={e}") from None
        try:
            check_prompt_settings(self.prompt_template, self.system_prompt, self.chat_template)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        require_positive("data.max_operand", self.max_operand, allow_zero=True)
        self._validate_held_out()
        require_positive("data.max_prompt_tokens", self.max_prompt_tokens)
        require_positive("data.eval_max_prompts", self.eval_max_prompts, allow_zero=True)
        require_positive("data.eval_samples", self.eval_samples)
        require_positive("data.eval_temperature", self.eval_temperature)
        if self.eval_task is not None and self.eval_solved_reward not in reward_names:
            raise ConfigError(
                f"data.eval_solved_reward={self.eval_solved_reward!r} is not a reward; rewards: {', '.join(reward_names)}"
            )

    def _validate_held_out(self) -> None:
        from moe_rl.data.tasks import BUILT_IN_TASKS, make_task

        require_positive("data.held_out", self.held_out, allow_zero=True)
        if not self.held_out:
            return
        if self.task not in BUILT_IN_TASKS:
            raise ConfigError(
                f"data.held_out={self.held_out} applies to the built-in tasks, not data.task={self.task!r}"
            )
        if self.eval_max_prompts > self.held_out:
            raise ConfigError(
                f"data.eval_max_prompts={self.eval_max_prompts} exceeds data.held_out={self.held_out} (the problems set aside)"
            )
        try:
            make_task(self.task, self.max_operand, held_out=self.held_out)
        except ValueError as e:
            raise ConfigError(f"data.{e}") from None

    def prompt_formatter(self, tokenizer: PreTrainedTokenizerBase) -> PromptFormatter:
        """How this run's problems become prompt ids."""
        return PromptFormatter(
            tokenizer, self.prompt_template, self.system_prompt, self.chat_template, self.max_prompt_tokens
        )
