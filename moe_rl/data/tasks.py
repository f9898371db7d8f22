"""Prompt sources. Each yields :class:`Problem` s (prompt text + reference answer) for a
step deterministically from (seed, step), so a resumed run sees the same data."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    """A prompt source: the same ``count`` problems for the same (seed, step)."""

    def problems(self, seed: int, step: int, count: int) -> list[Problem]: ...


class ArithmeticTask:
    """``a+b=`` with single-digit operands (by default); the answer goes in ``\\boxed{}``."""

    def __init__(self, max_operand: int = 9) -> None:
        self.max_operand = max_operand

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        rng = random.Random(seed * 1_000_003 + step)
        out = []
        for _ in range(count):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            out.append(Problem(f"{a}+{b}=", str(a + b)))
        return out

    @staticmethod
    def solution(problem: Problem) -> str:
        return f"\\boxed{{{problem.answer}}}"


class JsonlTask:
    """Lines of ``{"prompt": text, "answer": text}``; each step takes ``count`` lines of a
    seeded permutation (epochs wrap around). Malformed, empty or non-UTF-8 lines are
    skipped, each logged with file:line and counted (``skipped``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.items: list[Problem] = []
        self.skipped: list[str] = []  # "file:line: why" of every line left out
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                where = f"{path}:{line_no}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._skip(f"{where}: not UTF-8 ({e.reason} at byte {e.start})")
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    self._skip(f"{where}: not valid JSON ({e.msg})")
                    continue
                if not isinstance(record, dict) or not str(record.get("prompt", "")).strip() or "answer" not in record:
                    self._skip(f'{where}: needs a non-empty "prompt" and an "answer"')
                    continue
                self.items.append(Problem(str(record["prompt"]), str(record["answer"])))
        if not self.items:
            raise ValueError(f"{path} holds no usable problems ({len(self.skipped)} lines skipped)")

    def _skip(self, why: str) -> None:
        if len(self.skipped) < 20:
            log.warning("skipping %s", why)
        self.skipped.append(why)

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        n = len(self.items)
        out = []
        for k in range(step * count, (step + 1) * count):
            epoch, pos = divmod(k, n)
            order = list(range(n))
            random.Random(seed * 7919 + epoch).shuffle(order)
            out.append(self.items[order[pos]])
        return out


def make_task(spec: str, max_operand: int = 9):
    if spec == "arithmetic":
        return ArithmeticTask(max_operand)
    if Path(spec).is_file():
        return JsonlTask(spec)
    raise ValueError(f"data.task={spec!r} is neither 'arithmetic' nor a JSONL file")
