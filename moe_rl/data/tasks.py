"""Prompt sources. Each yields :class:`Problem` s (prompt text + reference answer) for a
step deterministically from (seed, step), so a resumed run sees the same data."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


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
    seeded permutation (epochs wrap around). Malformed lines are errors with file:line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.items: list[Problem] = []
        with open(path, encoding="utf-8", errors="strict") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not str(record.get("prompt", "")).strip() or "answer" not in record:
                    raise ValueError(f'{path}:{line_no}: needs a non-empty "prompt" and an "answer"')
                self.items.append(Problem(str(record["prompt"]), str(record["answer"])))
        if not self.items:
            raise ValueError(f"{path} holds no problems")

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
