"""No import circle in `pipeline/` and `cluster/`: the graph of which module imports which has no strongly
connected component of more than one module. Read from the source with `ast`, nothing is imported.

Every import counts, at any depth of the module: a function-level import, and one under `if TYPE_CHECKING:` too. A
function-level import runs later than a top-level one, but it still runs, and a circle it closes still means two
modules that each need the other; a TYPE_CHECKING import never runs, but it still says that one module's meaning
depends on the other's, and a circle through it is one edit (the import moved out of the guard, an annotation
evaluated) from a real one.

`from a.b import c` is an edge to the module `a.b.c` when that is a module, else to `a.b` (c is a name in it).
Importing `a.b.c` also runs the `__init__` of each package on the way (`a`, `a.b`), so the edge goes to those
too, except to the packages the importer itself is in: they began running before it did.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "cluster")


def _module_files() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name, for its __init__.py)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` is, or is in (its longest prefix that is a module); None outside the packages."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads (before resolving them to modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        # Relative: `from . import x` in a.b.c (a module) means a.b; in a package's __init__, the package itself.
        base = importer.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    return [f"{origin}.{alias.name}" for alias in node.names] + [origin]


def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: the line of the first import that loads it}."""
    modules = _module_files()
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for importer, path in modules.items():
        is_package = path.name == "__init__.py"
        own = set(_ancestors(importer)) | ({importer} if is_package else set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _targets(node, importer, is_package)
            if isinstance(node, ast.ImportFrom):
                # `from a.b import c`: the submodule a.b.c if there is one, else the module a.b; never both.
                origin = names.pop()
                names = [n if n in modules else origin for n in names] or [origin]
            for name in names:
                target = _resolve(name, modules)
                if target is None:
                    continue
                for module in [*_ancestors(target), target]:
                    if module != importer and module not in own:
                        graph[importer].setdefault(module, node.lineno)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit): the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _shortest_circle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One shortest circle through the component's first module (breadth-first inside the component)."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt in members and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start]


def _describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    modules = _module_files()
    members = set(component)
    edges = [
        f"    {a} -> {b}  ({modules[a].relative_to(ROOT)}:{line})"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in members
    ]
    circle = " -> ".join(_shortest_circle(graph, component))
    return f"  {', '.join(component)}\n    e.g. {circle}\n" + "\n".join(edges)


def test_the_graph_reads_the_imports_it_should():
    """The reader itself: a function-level import, a TYPE_CHECKING one, `from package import submodule` and a
    package's __init__ all make the edges they should."""
    graph = import_graph()
    assert "pipeline.runtime.hosting.launcher" in graph["pipeline.runtime.hosting.shifts"]
    assert "pipeline.runtime" in graph["pipeline.server.runner"]  # the package on the way runs too
    # Its own packages are already running when it imports a sibling.
    assert "pipeline.runtime" not in graph["pipeline.runtime.hosting.shifts"]
    assert "pipeline.endpoints.chat" in graph["pipeline.endpoints"]  # a package's __init__ is its own node
    assert "pipeline.server.outputs" in graph["pipeline.server.runner"]  # from pipeline.server import outputs
    assert "cluster.auth" in graph["pipeline.server.runner"]  # imported inside a function


def test_there_is_no_import_circle():
    graph = import_graph()
    circles = strongly_connected(graph)
    assert not circles, (
        f"{len(circles)} import circle(s); each line below is an import inside one (move what both need "
        "below both):\n" + "\n".join(_describe(graph, component) for component in circles)
    )


def test_tarjan_finds_circles_and_nothing_else():
    graph = defaultdict(dict, {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"d": 1}})
    assert strongly_connected(dict(graph)) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b": 1}, "b": {}}) == []
    assert _shortest_circle({"a": {"b": 1}, "b": {"a": 1}}, ["a", "b"]) == ["a", "b", "a"]
