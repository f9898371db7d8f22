"""Prompt sources. Each yields :class:`Problem` s (a prompt + reference answer) for a step
deterministically from (seed, step), so a resumed run sees the same data, and a fixed
list of held-out problems for evaluation.

Datasets are read from JSONL, Parquet (pyarrow) or a Hugging Face ``datasets`` directory
(``save_to_disk``; ``DIR:split`` picks a split of a ``DatasetDict``), with configurable,
optionally dotted field names (``reward_model.ground_truth``). A prompt field holds text,
or a list of chat messages (``[{"role": "user", "content": ...}]``, as verl's data does).
"""

from __future__ import annotations

import decimal
import difflib
import json
import logging
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

log = logging.getLogger(__name__)

ARITHMETIC = "arithmetic"
ARITHMETIC_CHAIN = "arithmetic_chain"  # a*b+c: a multi-step task for the calculator tool
BUILT_IN_TASKS = (ARITHMETIC, ARITHMETIC_CHAIN)
EVAL_SEED = 0x5EED  # the built-in task's held-out problems
FILE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
SKIPS_LOGGED = 5  # rows whose skipping is logged one by one (the rest are counted)
PROMPT_NAMES = ("prompt", "question", "problem", "input", "query", "instruction", "messages")
ANSWER_NAMES = ("answer", "ground_truth", "solution", "label", "target", "output", "final_answer")


@dataclass(frozen=True)
class Problem:
    prompt: str  # the question (for chat rows: the last user message)
    answer: str
    messages: tuple[dict, ...] | None = None  # the row's chat messages, when it holds a chat


class Task(Protocol):
    """A prompt source: the same ``count`` problems for the same (seed, step)."""

    holds_messages: bool  # some problems are chats (they need a chat template)

    @property
    def skipped(self) -> Sequence[str]:
        """The rows left out, each with where and why."""
        ...

    def problems(self, seed: int, step: int, count: int) -> list[Problem]: ...

    def eval_problems(self, limit: int) -> list[Problem]:
        """Up to ``limit`` problems (0: all) in a fixed order, for evaluation."""
        ...


class ArithmeticTask:
    """``a+b=`` with single-digit operands (by default); the answer goes in ``\\boxed{}``.
    ``held_out`` > 0 sets that many distinct problems aside (a fixed seeded choice): they are
    the evaluation's problems and are never drawn for training."""

    holds_messages = False
    skipped: tuple[str, ...] = ()
    OPERANDS = 2

    def __init__(self, max_operand: int = 9, held_out: int = 0) -> None:
        self.max_operand = max_operand
        space = (max_operand + 1) ** self.OPERANDS
        if not 0 <= held_out < space:
            raise ValueError(f"held_out={held_out} must be in [0, {space}): the task has {space} distinct problems")
        chosen = random.Random(EVAL_SEED).sample(range(space), held_out)
        self._held_out = [self._operands_of(i) for i in chosen]
        self._held_out_set = set(self._held_out)

    def _operands_of(self, index: int) -> tuple[int, ...]:
        """The ``index``-th operand tuple (base ``max_operand + 1`` digits)."""
        base, out = self.max_operand + 1, []
        for _ in range(self.OPERANDS):
            index, digit = divmod(index, base)
            out.append(digit)
        return tuple(out)

    def _problem(self, operands: tuple[int, ...]) -> Problem:
        a, b = operands
        return Problem(f"{a}+{b}=", str(a + b))

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        rng = random.Random(seed * 1_000_003 + step)
        out: list[Problem] = []
        while len(out) < count:
            operands = tuple(rng.randint(0, self.max_operand) for _ in range(self.OPERANDS))
            if operands not in self._held_out_set:  # (a held-out one is drawn again)
                out.append(self._problem(operands))
        return out

    def eval_problems(self, limit: int) -> list[Problem]:
        if self._held_out:
            return [self._problem(o) for o in self._held_out[: limit or None]]
        return self.problems(EVAL_SEED, 0, limit or 64)

    @staticmethod
    def solution(problem: Problem) -> str:
        return f"\\boxed{{{problem.answer}}}"


class ArithmeticChainTask(ArithmeticTask):
    """``a*b+c=`` (operands up to ``max_operand``): two steps, for tool-use rollouts."""

    OPERANDS = 3

    def _problem(self, operands: tuple[int, ...]) -> Problem:
        a, b, c = operands
        return Problem(f"{a}*{b}+{c}=", str(a * b + c))


class DatasetTask:
    """Rows of a dataset file or directory; each step takes ``count`` rows of a seeded
    permutation (epochs wrap around). Rows without a usable prompt or answer (and, in
    JSONL, lines that are not UTF-8 JSON objects) are skipped, each logged with where it
    is and counted (``skipped``)."""

    def __init__(self, spec: str, prompt_key: str = "prompt", answer_key: str = "answer") -> None:
        self.spec = spec
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.items: list[Problem] = []
        self._shuffled: tuple[tuple[int, int] | None, list[int]] = (None, [])  # (seed, epoch), its order
        self.skipped: list[str] = []  # "where: why" of every row left out
        first_row = None
        for where, row in read_rows(spec, self._skip):
            first_row = row if first_row is None else first_row
            problem = self._problem(row)
            if isinstance(problem, str):
                self._skip(f"{where}: {problem}")
            else:
                self.items.append(problem)
        if len(self.skipped) > SKIPS_LOGGED:
            log.warning(
                "... %d more rows skipped (%d of the %d rows read)",
                len(self.skipped) - SKIPS_LOGGED,
                len(self.skipped),
                len(self.skipped) + len(self.items),
            )
        if not self.items:
            raise ValueError(
                f"{spec} holds no usable problems ({len(self.skipped)} rows skipped){self._fields_hint(first_row)}"
            )
        self.holds_messages = any(p.messages is not None for p in self.items)

    def _fields_hint(self, row: Any) -> str:
        """What the first row holds, and the keys that would likely work."""
        if not isinstance(row, dict):
            return ""
        fields = row_fields(row)
        hints = []
        for setting, key, names in (
            ("data.prompt_key", self.prompt_key, PROMPT_NAMES),
            ("data.answer_key", self.answer_key, ANSWER_NAMES),
        ):
            if field_of(row, key) is None:
                guess = suggest_field(key, fields, names)
                hints.append(f"{setting}={key!r} is not among them" + (f" (try {setting}={guess})" if guess else ""))
        return f"; its rows hold the fields {', '.join(fields)}" + (": " + "; ".join(hints) if hints else "")

    def _problem(self, row: Any) -> Problem | str:
        """The row's problem, or why it has none."""
        if not isinstance(row, dict):
            return "not an object"
        prompt, answer = field_of(row, self.prompt_key), field_of(row, self.answer_key)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            return f'needs an answer in "{self.answer_key}"'
        text = answer_text(answer)
        if text is None:
            return f'needs a text or number answer in "{self.answer_key}", not a {type(answer).__name__}'
        if isinstance(prompt, str) and prompt.strip():
            return Problem(prompt, text)
        if _is_chat(prompt):
            users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
            if not users:
                return f'needs a user message in the chat in "{self.prompt_key}"'
            # up to the last user message: a reply after it (an SFT row's answer) is no prompt
            messages = tuple(dict(m) for m in prompt[: users[-1] + 1])
            return Problem(messages[-1]["content"], text, messages)
        return f'needs a non-empty prompt (text or chat messages) in "{self.prompt_key}"'

    def _skip(self, why: str) -> None:
        if len(self.skipped) < SKIPS_LOGGED:
            log.warning("skipping %s", why)
        self.skipped.append(why)

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        n = len(self.items)
        out = []
        for k in range(step * count, (step + 1) * count):
            epoch, pos = divmod(k, n)
            out.append(self.items[self._order(seed, epoch)[pos]])
        return out

    def _order(self, seed: int, epoch: int) -> list[int]:
        """The epoch's shuffled order of the rows, kept while the draws stay in the epoch
        (one shuffle of 10^6 rows takes ~0.5 s)."""
        if self._shuffled[0] != (seed, epoch):
            order = list(range(len(self.items)))
            random.Random(seed * 7919 + epoch).shuffle(order)
            self._shuffled = ((seed, epoch), order)
        return self._shuffled[1]

    def eval_problems(self, limit: int) -> list[Problem]:
        return self.items[:limit] if limit else list(self.items)


def answer_text(answer: Any) -> str | None:
    """A reference answer as the rewards read it: text as it is, an integer in digits, a
    float in positional notation (``str`` gives ``1e-05``, whose ``e`` math-verify reads as
    Euler's number); ``None`` for anything else (a list, a mapping)."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, int):  # (bool too)
        return str(answer)
    if isinstance(answer, float) and math.isfinite(answer):
        text = format(decimal.Decimal(repr(answer)), "f")
        return text.removesuffix(".0") if text.endswith(".0") else text
    return None


def field_of(row: dict, key: str) -> Any:
    """``row[key]``, following dots into nested mappings and, for a number, into lists
    (``prompt.-1.content``: the last message's text); a key that is itself dotted
    (``reward_model.ground_truth``, flattened) first as it is; ``None`` when missing."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif (
            isinstance(value, (list, tuple)) and re.fullmatch(r"-?\d+", part) and -len(value) <= int(part) < len(value)
        ):
            value = value[int(part)]
        else:
            return None
    return value


def row_fields(row: dict, prefix: str = "", depth: int = 3) -> list[str]:
    """The dotted keys of a row's fields (nested mappings followed ``depth`` deep; a chat
    is shown as one field)."""
    out = []
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and depth > 1:
            out += row_fields(value, f"{name}.", depth - 1)
        else:
            out.append(name + (" (chat messages)" if _is_chat(value) else ""))
    return out


def suggest_field(key: str, fields: list[str], likely: tuple[str, ...]) -> str | None:
    """The field most like ``key`` by name, or one whose last part is a ``likely`` name."""
    plain = [f.split(" ")[0] for f in fields]
    close = difflib.get_close_matches(key, plain, n=1, cutoff=0.6)
    if close:
        return close[0]
    return next((f for f in plain if f.rsplit(".", 1)[-1].lower() in likely), None)


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


# ------------------------------------------------------------------ reading datasets


def resolve_spec(spec: str) -> tuple[str, Path, str | None]:
    """``(format, path, split)`` of a dataset spec: a ``.jsonl``/``.json``/``.parquet`` file,
    or a ``datasets`` directory, ``DIR:split`` for one split. Raises ``ValueError`` saying
    what is wrong."""
    path, split = Path(spec), None
    if not path.exists() and ":" in spec:
        head, _, split = spec.rpartition(":")
        path = Path(head)
    if path.is_dir():
        return "datasets", path, split
    if not path.is_file():
        raise ValueError(
            f"{spec!r} is neither a built-in task ({', '.join(BUILT_IN_TASKS)}) nor an existing dataset file or directory"
        )
    if split is not None or path.suffix.lower() not in FILE_FORMATS:
        raise ValueError(f"{spec!r}: a dataset file must end in .jsonl, .json (JSON lines) or .parquet")
    return FILE_FORMATS[path.suffix.lower()], path, None


def read_rows(spec: str, skip) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of every row; unreadable JSONL lines go to ``skip(why)``."""
    kind, path, split = resolve_spec(spec)
    if kind == "jsonl":
        yield from _jsonl_rows(path, skip)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
    else:
        for i, row in enumerate(_load_dataset_dir(path, split)):
            yield f"{spec}:row {i}", row


def _jsonl_rows(path: Path, skip) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # (a byte-order mark: an editor's)
            except UnicodeDecodeError as e:
                skip(f"{where}: not UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                skip(f"{where}: not valid JSON ({e.msg})")


def _load_dataset_dir(path: Path, split: str | None):
    """A ``datasets`` ``save_to_disk`` directory (one split of a ``DatasetDict``)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"{path} is not a saved Hugging Face dataset ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None or split not in loaded:
            splits = ", ".join(loaded)
            raise ValueError(f"{path} holds the splits {splits}: name one, as {path}:{next(iter(loaded))}")
        return loaded[split]
    if split is not None:
        raise ValueError(f"{path} holds one dataset without splits: drop ':{split}'")
    return loaded


def make_task(
    spec: str, max_operand: int = 9, prompt_key: str = "prompt", answer_key: str = "answer", held_out: int = 0
) -> Task:
    """A built-in task (``held_out`` problems set aside for evaluation), or a :class:`DatasetTask`
    (``ValueError`` if it cannot be read)."""
    if spec == ARITHMETIC:
        return ArithmeticTask(max_operand, held_out)
    if spec == ARITHMETIC_CHAIN:
        return ArithmeticChainTask(max_operand, held_out)
    return DatasetTask(spec, prompt_key, answer_key)
