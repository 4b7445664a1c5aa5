"""Layers a reader can follow: nothing under reclaim/models imports an engine, the server or a CLI,
and no module of reclaim imports itself back through others (no import cycles).

Read from the source with `ast` (nothing is imported, so no torch). Every import statement counts,
at any depth: module level, inside a function, under `if TYPE_CHECKING:`. A function-level import
hides a cycle from Python at import time but not from a reader, so the fix is to move the shared
code down a layer, not to defer the import. `from X import n` is an edge to the module X.n when
there is one, else to X; the parent packages an import runs implicitly are not edges (a package's
__init__ re-exporting its own submodules is not a cycle).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import reclaim

RECLAIM = Path(reclaim.__file__).parent
MODELS = RECLAIM / "models"
BOTTOM = ("reclaim.storage", "reclaim.paths")  # what everything may import; they import no reclaim
ABOVE = ("reclaim.ssm", "reclaim.engine", "reclaim.server", "reclaim.online", "reclaim.rl", "reclaim.drafter",
         "reclaim.bench", "reclaim.cli", "reclaim.data")


def module_name(path: Path) -> str:
    """reclaim/models/llama.py -> reclaim.models.llama; a package's __init__.py is the package."""
    parts = ("reclaim",) + path.relative_to(RECLAIM).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in a file, at any depth: `import a.b` gives a.b, and
    `from a import b` gives a.b (a module or a name in a; see `resolve`). Relative imports resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from the file's own
                up = ".".join(package.split(".")[:len(package.split(".")) - (node.level - 1)])
                base = f"{up}.{base}" if base else up
            names += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return names


@cache
def files() -> dict[str, Path]:
    """Every module of reclaim by dotted name."""
    return {module_name(f): f for f in sorted(RECLAIM.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The reclaim module an imported name lives in (a.b.n -> a.b.n if a module, else a.b); None outside."""
    for candidate in (name, name.rpartition(".")[0]):
        if candidate in files():
            return candidate
    return None


@cache
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}, within reclaim."""
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files().items():
        graph[mod] = {}
        for name, line in imported_names(path):
            target = resolve(name)
            if target is not None and target != mod:
                graph[mod].setdefault(target, line)
    return graph


def tangles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted:
    each set of modules that import one another round in a cycle, reported once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """[a, b, ..., a]: the shortest cycle from the component's first module back to itself."""
    start = component[0]
    came_from = {start: start}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if w in component and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {component}")  # a strongly connected component has one


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """The shortest cycle, then every import inside the component (each a place to cut it)."""
    def where(a: str, b: str) -> str:
        return f"{files()[a].relative_to(RECLAIM.parent)}:{graph[a][b]}"

    cycle = shortest_cycle(graph, component)
    edges = [f"    {where(a, b)} imports {b}" for a in component for b in sorted(graph[a]) if b in component]
    return " -> ".join(cycle) + "\n" + "\n".join(edges)


def test_models_import_nothing_from_engines_or_server():
    models = [f for f in files().values() if f.is_relative_to(MODELS)]
    assert any(f.name == "mamba.py" for f in models) and any(f.parent.name == "kernels" for f in models)
    bad = {f"{f.relative_to(RECLAIM.parent)}: {m}" for f in models for m, _ in imported_names(f)
           if any(m == a or m.startswith(a + ".") for a in ABOVE)}
    assert not bad, f"reclaim.models must not import from {ABOVE}: {sorted(bad)}"


def test_the_bottom_layer_imports_nothing_from_reclaim():
    graph = import_graph()
    assert {m: sorted(graph[m]) for m in BOTTOM if graph[m]} == {}


def test_no_import_cycles_in_reclaim():
    graph = import_graph()
    # the graph sees module-level, function-level and relative imports
    assert "reclaim.models.llama" in graph["reclaim.models.loading"]
    assert "reclaim.models.loading" in graph["reclaim.ssm.train"]
    found = tangles(graph)
    assert not found, "import cycles (move the code both sides need to a lower module):\n" + "\n".join(
        describe(graph, c) for c in found)


def test_cycle_finder_reports_each_tangle_once_with_a_cycle_through_it():
    graph = {"a": {"b": 1}, "b": {"c": 2, "d": 3}, "c": {"a": 4, "b": 5}, "d": {}, "e": {"f": 5}, "f": {"e": 6},
             "g": {"a": 7}}
    assert tangles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert tangles({"a": {"b": 1}, "b": {}}) == []


MAX_LINES = 600  # one file, one job: a module past this is doing two


def test_no_module_is_over_600_lines():
    long = {name: n for name, path in files().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"
