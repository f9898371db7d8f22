"""The package's import graph: imports that run upward and import circles (files and folders).

    python -m tools.dev.import_graph            # a summary; exit 1 if anything runs upward or circles
    python -m tools.dev.import_graph --edges    # every module's imports too

Every import counts, a function's lazy import as much as a top-level one. Layers, lowest
first (a module may import its own layer and the ones below):
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("moe_rl", "parallel")

# Lowest first. A module belongs to the longest prefix it starts with ("name$": that module only).
LAYERS: list[tuple[str, ...]] = [
    ("parallel",),
    ("moe_rl$", "moe_rl.tags", "moe_rl.checks", "moe_rl.disk"),  # moe_rl$: the package itself (its version)
    ("moe_rl.data", "moe_rl.rewards", "moe_rl.algorithms"),
    ("moe_rl.models", "moe_rl.routing"),
    ("moe_rl.rollout",),
    ("moe_rl.environments",),
    ("moe_rl.config",),
    ("moe_rl.experience",),
    ("moe_rl.checkpoint",),
    ("moe_rl.trainer",),
    ("moe_rl.report", "moe_rl.claims"),
    ("moe_rl.commands",),
    ("moe_rl.cli", "moe_rl.train"),
]
__doc__ += "\n".join("    " + ", ".join(layer) for layer in LAYERS) + "\n"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, depth = len(LAYERS), -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if p.endswith("$"):
                if module == p[:-1]:
                    return i
                continue
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    return best


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules a file imports (``from a import b`` counts ``a.b`` if that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def folder_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def build() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", action="store_true", help="print every module's imports")
    args = parser.parse_args()
    graph = build()
    upward = [(a, b) for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a)]
    # a package's __init__ re-exporting its own modules is not a circle
    file_graph = {
        a: {b for b in deps if not (b.startswith(a + ".") and a.count(".") < b.count("."))} for a, deps in graph.items()
    }
    folder_graph: dict[str, set[str]] = defaultdict(set)
    for a, deps in graph.items():
        for b in deps:
            if folder_of(a) != folder_of(b):
                folder_graph[folder_of(a)].add(folder_of(b))
    file_cycles, folder_cycles = cycles(file_graph), cycles(dict(folder_graph))
    lines = {
        a: sum(1 for _ in (ROOT / (a.replace(".", "/") + ".py")).open())
        for a in graph
        if (ROOT / (a.replace(".", "/") + ".py")).exists()
    }
    if args.edges:
        for a in sorted(graph):
            print(f"{a} -> {', '.join(sorted(graph[a])) or '-'}")
    print(
        f"{len(graph)} modules, {sum(len(d) for d in graph.values())} imports, largest {max(lines.values())} lines ({max(lines, key=lines.get)})"
    )
    print(f"upward imports: {len(upward)}")
    for a, b in sorted(upward):
        print(f"  {a} -> {b}")
    print(f"file circles: {len(file_cycles)}")
    for c in file_cycles:
        print("  " + " <-> ".join(c))
    print(f"folder circles: {len(folder_cycles)}")
    for c in folder_cycles:
        print("  " + " <-> ".join(c))
    return 1 if upward or file_cycles or folder_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
