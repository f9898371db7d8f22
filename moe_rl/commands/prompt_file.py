"""The prompt files of ``moe-rl drift`` (both its checkpoint and its engine forms)."""

from __future__ import annotations

import json


def read_prompts(path: str | None, tokenizer_dir: str, limit: int | None) -> list[list[int]]:
    """Token ids of each JSONL line's ``prompt`` (text: tokenized) or ``input_ids``."""
    if path is None:
        raise ValueError("--prompts is needed when --a or --b is a model directory")
    prompts: list[list[int]] = []
    tokenizer = None
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--prompts {path!r} cannot be read: {e.strerror or e}") from None
    with f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            value = record.get("input_ids", record.get("prompt")) if isinstance(record, dict) else None
            if isinstance(value, str):
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
                value = tokenizer(value)["input_ids"]
            if not isinstance(value, list) or not value or not all(isinstance(t, int) for t in value):
                raise ValueError(f'{path}:{line_no}: needs "prompt" (text or token ids) or "input_ids"')
            prompts.append(value)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts
