"""No import cycles among deepinfer's own modules, and every module imports on its own.

The graph is read from the source with `ast`: an edge for every import a module names, wherever it
stands: at the top level, inside a function (a deferred import still means "this module needs
that one"), and under `if TYPE_CHECKING:` (an annotation that names a module's type still ties the
two). So a cycle cannot hide behind a lazy import: each dependency points down the tree, to the
shared types (deepinfer/types/) at the bottom. The recipe's modules are in the graph too, and must
not import deepinfer or torch at all.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

PACKAGES = ("deepinfer", "deepinfer_recipe")
# Cycles another branch is breaking; each entry must still be a cycle (delete it once it is not).
KNOWN_CYCLES: list[set[str]] = []


def package_modules() -> dict[str, Path]:
    """Every module of the two packages (name -> file), found without importing them."""
    modules = {}
    for package in PACKAGES:
        root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports: `from a.b import c` is a.b.c when that is a module,
    else a.b; the parent packages Python imports on the way are not edges (every module would
    then depend on its package's __init__)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:   # relative: one level is the module's own package
            anchor = package
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return targets


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's cycles, as its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            visit(v)
    return components


def test_no_import_cycles_among_package_modules():
    modules = package_modules()
    graph = {name: {t for t in imported_modules(name, path, modules)
                    if t in modules and t != name}
             for name, path in modules.items()}
    cycles = strongly_connected(graph)
    unknown = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not unknown, f"import cycles (lazy and type-only imports count too): {unknown}"
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not stale, f"no longer cycles, delete them from KNOWN_CYCLES: {stale}"


def test_the_recipe_imports_neither_deepinfer_nor_torch():
    """deepinfer-recipe is its own torch-free distribution, which deepinfer depends on."""
    modules = package_modules()
    offenders = {}
    for name, path in modules.items():
        if name.split(".")[0] == "deepinfer_recipe":
            bad = {t for t in imported_modules(name, path, modules)
                   if t.split(".")[0] in ("deepinfer", "torch")}
            if bad:
                offenders[name] = sorted(bad)
    assert not offenders


def test_every_module_imports_in_a_fresh_interpreter():
    """Each module of both packages, imported one after another in a new interpreter. A module
    may only fail for a third-party package this machine lacks (Triton on a CPU box)."""
    script = """
import importlib, importlib.util, json, sys
failures, skipped = {}, {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top and top not in ("deepinfer", "deepinfer_recipe") and importlib.util.find_spec(top) is None:
            skipped[name] = top
        else:
            failures[name] = repr(e)
    except Exception as e:
        failures[name] = repr(e)
print(json.dumps({"failures": failures, "skipped": skipped}))
"""
    names = sorted(n for n in package_modules() if not n.endswith(".__main__"))   # __main__ runs the CLI
    result = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failures"] == {}
    assert len(names) - len(report["skipped"]) > 100   # the walk found the packages
