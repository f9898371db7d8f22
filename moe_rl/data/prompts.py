"""Problems -> prompt token ids: an instruction template, then (optionally) the
tokenizer's own chat template with a system prompt; long prompts are left-truncated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_rl.data.tasks import Problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT_FIELD = "{prompt}"
CHAT_TEXT_HINT = "a message's text (e.g. prompt.-1.content: the last message of the prompt field)"


@dataclass(frozen=True)
class PromptFormatter:
    """How a run turns a :class:`Problem` into the ids the engine continues.

    ``template`` wraps the question (``{prompt}`` stands for it; other braces are kept as
    written, so ``\\boxed{}`` needs no escaping). With ``chat_template`` the text becomes the
    user message (after ``system_prompt``, if any) of the tokenizer's chat template, with the
    generation prompt added; a problem that already is a chat keeps its messages."""

    tokenizer: PreTrainedTokenizerBase
    template: str = PROMPT_FIELD
    system_prompt: str = ""
    chat_template: bool = False
    max_tokens: int = 64

    def __post_init__(self) -> None:
        check_prompt_settings(self.template, self.system_prompt, self.chat_template)
        if self.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                'data.chat_template=true, but the model\'s tokenizer has no chat template: add one ("chat_template" in its '
                f"tokenizer_config.json, e.g. its instruct variant's), or set data.chat_template=false and point data.prompt_key at {CHAT_TEXT_HINT}"
            )

    def text(self, problem: Problem) -> str:
        """The prompt as text (chat template applied when on)."""
        if not self.chat_template:
            if problem.messages is not None:
                raise ValueError(
                    f"this problem is a chat (a list of messages): set data.chat_template=true, or point data.prompt_key at {CHAT_TEXT_HINT}"
                )
            return self.template.replace(PROMPT_FIELD, problem.prompt)
        messages = list(
            problem.messages or [{"role": "user", "content": self.template.replace(PROMPT_FIELD, problem.prompt)}]
        )
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, problem: Problem) -> tuple[list[int], bool]:
        """``(ids, truncated)``: the prompt's ids, the last ``max_tokens`` of them if longer."""
        return self.encode_all([problem])[0]

    def encode_all(self, problems: list[Problem]) -> list[tuple[list[int], bool]]:
        """:meth:`encode` of each problem, in one tokenizer call."""
        # a chat template writes its own special tokens (BOS and the like)
        texts = [self.text(problem) for problem in problems]
        encoded = self.tokenizer(texts, add_special_tokens=not self.chat_template)["input_ids"] if texts else []
        return [(ids[-self.max_tokens :], True) if len(ids) > self.max_tokens else (ids, False) for ids in encoded]


def check_prompt_settings(template: str, system_prompt: str, chat_template: bool) -> None:
    """``ValueError`` naming the ``data.*`` key when the settings cannot work together."""
    if PROMPT_FIELD not in template:
        raise ValueError(f"data.prompt_template={template!r} must contain {PROMPT_FIELD} (where the question goes)")
    if system_prompt and not chat_template:
        raise ValueError("data.system_prompt needs data.chat_template=true (a system prompt is a chat message)")
