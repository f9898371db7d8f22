"""The front door holds together: every relative link in README.md and docs/ names a file
that exists (and an anchor that file has), and each dated benchmark report is what
tools/bench/report.py makes of the figures stored next to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.bench.report import render

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPORTS = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = (line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#"))
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _broken_links(page: Path) -> list[str]:
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are not links
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert not _broken_links(page), f"{page.relative_to(ROOT)}: {_broken_links(page)}"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nope) [web](https://x.org/y)\n")
    assert _broken_links(page) == ["missing.md (no such file)", "there.md#nope (no such heading)"]


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.name)
def test_benchmark_reports_are_rendered_from_their_figures(report: Path) -> None:
    import json

    figures = report.with_suffix(".json")
    assert figures.exists(), f"{report.name} has no {figures.name}: write reports with python -m tools.bench.report"
    table = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    rendered = [
        line for line in render(json.loads(figures.read_text()), "", "", "").splitlines() if line.startswith("| ")
    ]
    assert table == rendered, f"{report.name} was edited by hand or its figures changed: render it again"
