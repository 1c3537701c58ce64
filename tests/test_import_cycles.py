"""Imports inside claas_verl run one way: no module reaches itself again through its imports, and the layers of the
layout hold (pure math imports neither verl nor Ray nor the glue; shared glue imports neither system; the two
systems do not import each other).

The graph is read from the source (every ``import``, also those inside functions), so a lazy import that
only hides a circle at load time is still found; imports under ``if TYPE_CHECKING:`` are not edges.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "claas_verl"
# the math: torch (numpy) only, no verl, no Ray, nothing of claas_verl but utils (a config reader may take an OmegaConf
# node)
PURE = ("claas_verl.losses", "claas_verl.distill", "claas_verl.align", "claas_verl.schedule", "claas_verl.metrics")
# shared layers below both systems
SHARED = ("claas_verl.utils", "claas_verl.verl_ext", "claas_verl.sandbox", "claas_verl.preflight", *PURE)
SYSTEMS = ("claas_verl.claas", "claas_verl.mopd")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only, never imported at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def imported_names(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports at run time (``from a import b`` gives ``a`` and ``a.b``)."""
    targets = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
    return targets


def import_graph() -> dict[str, set[str]]:
    """module -> the claas_verl modules it imports (a package's own ``__init__`` is not an edge of its children)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py") if not p.name.startswith("_") or p.name == "__init__.py"}
    graph = {}
    for name, path in paths.items():
        graph[name] = {t for t in imported_names(path) if t in paths and t != name and not name.startswith(t + ".")}
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


def test_no_import_cycles():
    assert cycles(import_graph()) == [], "import circles"


def _under(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_pure_math_imports_only_torch_and_utils():
    bad = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if not _under(name, PURE):
            continue
        wrong = {t for t in imported_names(path)
                 if t.split(".")[0] in ("verl", "ray", "vllm", "hydra")
                 or (t.startswith("claas_verl.") and not _under(t, (*PURE, "claas_verl.utils")))}
        if wrong:
            bad[name] = sorted(wrong)
    assert bad == {}, f"pure math modules importing verl/Ray/glue: {bad}"


def test_layers_hold():
    """Shared layers import neither system; each system imports only the shared layers and itself."""
    bad = []
    for name, targets in import_graph().items():
        for t in targets:
            if _under(name, SHARED) and _under(t, SYSTEMS):
                bad.append(f"{name} -> {t} (shared layer importing a system)")
            for mine, other in (SYSTEMS, SYSTEMS[::-1]):
                if _under(name, (mine,)) and _under(t, (other,)):
                    bad.append(f"{name} -> {t} (one system importing the other)")
    assert bad == [], "\n".join(bad)
