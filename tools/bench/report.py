"""A benchmark run's report in Markdown, made from its ``bench.json`` (figures are never typed
by hand): the date, the commit, the machine, and the table ``tools/bench/run.py`` prints; the
figures go next to it as JSON (tests/unit/test_docs.py renders them again and compares).

    .venv/bin/python -m tools.bench.report bench.json docs/benchmarks/2026-12-04-cpu-2core.md
    .venv/bin/python -m tools.bench.run --report docs/benchmarks/DATE-MACHINE.md   # measure and write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from tools.bench.run import ROOT, table_rows


def machine() -> str:
    """This machine in a line: the CPU's model, its cores, the GPU if any, torch."""
    import torch

    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line),
        platform.processor() or "unknown CPU",
    ) if Path("/proc/cpuinfo").exists() else platform.processor()  # fmt: skip
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{model}, {os.cpu_count()} cores, {gpu}; Python {platform.python_version()}, torch {torch.__version__}"


def commit() -> str:
    """The checkout's commit (``+`` when the tree has changes), or ``unknown``."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def render(results: dict, date: str, at_commit: str, on_machine: str) -> str:
    rows = table_rows(results)
    lines = [
        f"# Benchmarks {date}",
        "",
        f"Commit `{at_commit}`; {on_machine}; {results['threads']} torch threads; "
        f"{'quick' if results['quick'] else 'full'} run, {results['wall_s']:.0f} s. Written by "
        "`python -m tools.bench.report` from the run's `bench.json` (`python -m tools.bench.run`): every figure below "
        "was measured in this one run, side by side. What each row measures: [Benchmarks](../benchmarks.md).",
        "",
        "| what | figure |",
        "|---|---|",
        *(f"| {_indented(what)} | {figure.strip()} |" for what, figure in rows),
        "",
    ]
    return "\n".join(lines)


def _indented(what: str) -> str:
    """A row's label, its console indentation kept (a sub-row of the row above)."""
    depth = len(what) - len(what.lstrip(" "))
    return "&nbsp;" * depth + what.strip()


def write_report(results: dict, out: Path) -> None:
    """``out`` and, next to it, the figures it was made from (``out`` with ``.json``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, time.strftime("%Y-%m-%d"), commit(), machine()))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json').name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench_json", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args()
    write_report(json.loads(args.bench_json.read_text()), args.out)


if __name__ == "__main__":
    main()
