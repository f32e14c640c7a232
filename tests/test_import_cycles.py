"""No import circle among the modules of gateway, engine, ipc and kernels (issue 26). Every
import counts: at the top, inside functions (a lazy import must not hide a circle), under
TYPE_CHECKING, and import-string tables (`importlib.import_module("x.y")`, a dict of module
names such as kernels' backend table)."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "engine", "ipc", "kernels")

Graph = dict[str, dict[str, str]]  # module -> {imported module: "file:line" of the import}


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(module: str, is_package: bool, node: ast.AST, known: set[str]) -> list[str]:
    """The project modules one AST node imports (the most specific module each name is)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            parent = here[: len(here) - node.level + 1]
            base = ".".join(parent + ([node.module] if node.module else []))
        # NOTE: `from pkg import sub` imports the submodule pkg.sub; `from pkg import name`
        # imports pkg (its __init__)
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                for a in node.names if f"{base}.{a.name}" in known or base in known]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant)):
        return [node.args[0].value] if node.args[0].value in known else []
    if isinstance(node, ast.Dict) and node.values and all(
            isinstance(v, ast.Constant) and v.value in known for v in node.values):
        return [v.value for v in node.values]  # an import-string table
    return []


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Graph:
    files = module_files(root, packages)
    known = set(files)
    graph: Graph = {}
    for module, path in files.items():
        edges: dict[str, str] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(module, path.name == "__init__.py", node, known):
                if target != module:
                    edges.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
        graph[module] = edges
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

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
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(component: list[str], graph: Graph) -> str:
    """One circle through the component's first module, each step with where it imports."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w in members and w not in came_from:
                came_from[w] = v
                queue.append(w)
    path, v = [], start
    while True:
        u = came_from[v]
        path.append(f"{u} -> {v} ({graph[u][v]})")
        v = u
        if v == start:
            break
    return "circle: " + "; ".join(reversed(path))


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100  # NOTE: the scan found the packages (a wrong ROOT finds nothing)
    found = circles(graph)
    assert not found, "\n".join(describe(c, graph) for c in found)


def test_a_circle_hidden_by_a_lazy_import_or_a_string_table_is_found(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    from pkg.a import x\n    return x\n",
        "pkg/c.py": 'TABLE = {"d": "pkg.d"}\n',
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n",
        "pkg/e.py": "from . import a\n",  # into the a/b circle, not part of it
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.e"] == {"pkg.a": "pkg/e.py:1"}
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert describe(["pkg.a", "pkg.b"], graph) == (
        "circle: pkg.a -> pkg.b (pkg/a.py:1); pkg.b -> pkg.a (pkg/b.py:2)")
