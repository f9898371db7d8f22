"""The config reference: every key of moe-rl's config tree with its default and the comment
written beside it in ``moe_rl/config.py`` (or its section's dataclass), as Markdown tables.

    python -m tools.dev.config_reference            # print the tables
    python -m tools.dev.config_reference --check    # exit 1 if docs/config-reference.md's copy differs
    python -m tools.dev.config_reference --write    # replace docs/config-reference.md's copy

docs/config-reference.md holds the tables between ``<!-- config-reference -->`` markers; a test keeps
them equal to this script's output, so the documented defaults are the code's.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- config-reference -->", "<!-- /config-reference -->"


def field_comments(cls: type) -> dict[str, str]:
    """``field -> comment``: the comment lines right above a field, then the one on its line."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0]
        if (
            ":" not in stripped
            or not name.isidentifier()
            or line.startswith((" " * 8, "\t\t"))
            or stripped.startswith(("def ", "@", "#"))
        ):
            continue
        above, k = [], number - 1
        while k in comments and lines[k - 1].strip().startswith("#"):
            above.insert(0, comments[k])
            k -= 1
        text = " ".join(above + ([comments[number]] if number in comments else []))
        if text:
            out[name] = text
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return ""
        value = (
            [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
            if isinstance(value, list)
            else value
        )
    else:
        return ""
    text = json.dumps(value) if not isinstance(value, str) else (f'"{value}"' if value else '""')
    return text if len(text) <= 60 else text[:57] + "..."


def _rows(prefix: str, cls: type) -> list[str]:
    """A section's table rows; a nested section's keys under its own (``rollout.simulate_mismatch.*``)."""
    comments = {}
    for klass in reversed(cls.__mro__[:-1]):
        if dataclasses.is_dataclass(klass):
            comments.update(field_comments(klass))
    rows = []
    for f in dataclasses.fields(cls):
        nested = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested):
            rows += _rows(f"{prefix}.{f.name}", type(nested))
        else:
            rows.append(f"| `{prefix}.{f.name}` | `{_default(f)}` | {comments.get(f.name, '').replace('|', '/')} |")
    return rows


def reference() -> str:
    """Markdown: one table per config section, then the keys that moved and where to."""
    from moe_rl.config import Config
    from moe_rl.rollout.settings import MOVED_KEYS

    parts = []
    for section in dataclasses.fields(Config):
        rows = _rows(section.name, section.default_factory().__class__)
        parts.append(f"**`{section.name}`**\n\n| key | default | meaning |\n|---|---|---|\n" + "\n".join(rows))
    moved = [f"| `rollout.{old}` | `rollout.{new}` |" for old, new in MOVED_KEYS.items()]
    parts.append(
        "**Keys that moved** (the old name still works, with one warning line naming the new place)"
        "\n\n| old key | now |\n|---|---|\n" + "\n".join(moved)
    )
    return "\n\n".join(parts) + "\n"


def page_copy(page: str) -> str:
    """The tables between the markers of ``page`` (the text of docs/config-reference.md)."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[start:end].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if docs/config-reference.md's tables differ from the code's"
    )
    mode.add_argument("--write", action="store_true", help="replace docs/config-reference.md's tables")
    args = p.parse_args(argv)
    tables = reference()
    page_path = ROOT / "docs" / "config-reference.md"
    if args.check:
        if page_copy(page_path.read_text()) != tables:
            print(
                "docs/config-reference.md differs from moe_rl/config.py: run python -m tools.dev.config_reference --write",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.write:
        text = page_path.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        page_path.write_text(text[:start] + "\n" + tables + text[end:])
        return 0
    print(tables, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
