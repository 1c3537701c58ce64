"""Imports inside claas_verl run one way: no module reaches itself again through its imports.

The graph is read from the source (every ``import``, also those inside functions), so a lazy import that
only hides a circle at load time is still found. ``ACYCLIC`` lists the folders already held to it.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "claas_verl"
ACYCLIC = ("claas_verl.envs", "claas_verl.metrics")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the claas_verl modules it imports (a package's own ``__init__`` is not an edge of its children)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[name] = {t for t in targets if t in paths and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_lazy_circle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycles_in_the_acyclic_folders():
    bad = [c for c in cycles(import_graph()) if any(m.startswith(ACYCLIC) for m in c)]
    assert bad == [], f"import circles: {bad}"
