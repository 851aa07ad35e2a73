"""The house's shape, held by tests: no import circles, rooms of a readable size, each
parallelism axis in its own planner room, no reaching into another module's private
names, hooks/ holding Kedro hooks only.

These read the source as text (`ast`); nothing of meshtrain is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "meshtrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _import_statements(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module loads, and those under `if TYPE_CHECKING:` (a
    circle through type hints is still one room in two files); not those in functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try):
            pending += node.body + node.orelse
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imported_modules(module: str, path: Path) -> set[str]:
    """The package's modules `module` imports (a `from pkg import name` counts `pkg.name`
    where that is a module)."""
    names: set[str] = set()
    for node in _import_statements(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        source = _absolute(node, module, path.name == "__init__.py")
        names.add(source)
        names.update(f"{source}.{alias.name}" for alias in node.names)
    # A module importing its own package's face is not an arrow back into itself.
    return {n for n in names if n in MODULES and n != module and not module.startswith(n + ".")}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    graph = {name: _imported_modules(name, path) for name, path in MODULES.items()}
    assert _circles(graph) == []


def test_planner_modules_fit_a_read() -> None:
    long = {
        name: n
        for name, path in MODULES.items()
        if name.startswith("meshtrain.planner") and (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}


# Each parallelism axis's `parallel.*` degree (and ZeRO-1, the data axis's option) may be
# named by its own axis module, by `options` (the one reader of `auto`) and by `command`
# (the CLI's flags), nowhere else in the planner: a new axis is one module and a line.
AXIS_NAMES = (
    "data_parallel_size",
    "zero_1",
    "sharded_data_parallel_degree",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "context_parallel_size",
)


def test_each_parallelism_axis_is_named_in_at_most_three_planner_modules() -> None:
    planner = {n: p.read_text() for n, p in MODULES.items() if n.startswith("meshtrain.planner")}
    naming = {
        name: sorted(m for m, text in planner.items() if re.search(rf"\b{name}\b", text))
        for name in AXIS_NAMES
    }
    assert {name: modules for name, modules in naming.items() if len(modules) > 3} == {}
    assert all(naming.values())  # the names are still the planner's


def test_no_module_imports_another_modules_private_names() -> None:
    reaching = []
    for name, path in MODULES.items():
        for node in _import_statements(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                reaching += [
                    f"{name}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                    and not alias.name.startswith("__")
                    and _absolute(node, name, path.name == "__init__.py").startswith("meshtrain")
                ]
    assert reaching == []
