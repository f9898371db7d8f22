"""Prompts and answers: the built-in arithmetic task, JSONL data, the demo tokenizer."""
