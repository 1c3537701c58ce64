"""Imports inside claas_verl run one way: no module reaches itself again through its imports, and the layers of the
layout hold (pure math imports neither verl nor Ray nor the glue; shared glue imports neither system; the two
systems do not import each other; only the edge imports the offline test models of ``claas_verl.tiny``), and each
layer imports only the third-party packages its allow-list names.

The graph is read from the source (every ``import``, also those inside functions), so a lazy import that
only hides a circle at load time is still found; imports under ``if TYPE_CHECKING:`` are not edges. A module named
by a string is an import too: ``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)`` with a
literal name, verl's ``pkg://claas_verl...`` paths, and any string that is exactly a dotted ``claas_verl`` module
name (a table of names handed to ``import_module`` in a loop).
"""

import ast
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "claas_verl"
# the math: torch and numpy only, no verl, no Ray, nothing of claas_verl but utils (the MOPD layer reads the recipe and
# counts prompt files for the planner: claas_verl/mopd/recipe_schedule.py; the glue draws the figures:
# claas_verl/utils/plots.py)
PURE = ("claas_verl.losses", "claas_verl.distill", "claas_verl.align", "claas_verl.schedule", "claas_verl.metrics")
# shared layers below both systems
SHARED = ("claas_verl.utils", "claas_verl.verl_ext", "claas_verl.sandbox", "claas_verl.preflight", *PURE)
SYSTEMS = ("claas_verl.claas", "claas_verl.mopd")
# the offline tiny models and data (CPU tests and the benchmark's bundles): only the edge and tiny itself import them
TINY = "claas_verl.tiny"
# the edge besides tiny: the package root (it imports both systems), the entry points and their helpers (exact names)
EDGE = ("claas_verl", "claas_verl.main_claas", "claas_verl.main_mopd", "claas_verl.plan", "claas_verl.paths",
        "claas_verl.config_resolvers")

# The third-party packages (top-level names; the standard library is always allowed) each layer may import. A new
# dependency of a layer is a decision: add it here, and for the math say why in the README's layout section.
MATH_PACKAGES = {"torch", "numpy"}  # numpy: metrics/ and the schedule's block spreading (README, "the math")
SHARED_PACKAGES = MATH_PACKAGES | {"verl", "ray", "omegaconf", "hydra", "transformers", "peft", "psutil", "pyarrow",
                                   "pyseccomp", "transfer_queue", "matplotlib"}
SYSTEM_PACKAGES = SHARED_PACKAGES | {
    "anyio", "fastapi", "uvicorn", "httpx", "prometheus_client", "openai", "vllm", "safetensors", "pandas", "yaml",
    "reasoning_gym", "lm_eval", "evalplus", "math_verify", "nltk",
    "evaluation_lib"}  # evaluation_lib: IFBench's checker, imported from the checkout that --ifbench-repo names
EDGE_PACKAGES = SHARED_PACKAGES | {"httpx", "filelock", "reasoning_gym", "tokenizers"}


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


_IMPORT_CALLS = ("import_module", "__import__")
_PKG_PATH = re.compile(r"pkg://([A-Za-z_][\w.]*)")
_MODULE_NAME = re.compile(r"claas_verl(\.[A-Za-z_]\w*)+")


def _called_name(node: ast.Call) -> str | None:
    return getattr(node.func, "attr", getattr(node.func, "id", None))


def imported_names_in(source: str) -> set[str]:
    """Every absolute module name ``source`` imports at run time (``from a import b`` gives ``a`` and ``a.b``), by
    statement or by string: a literal first argument of ``import_module`` / ``__import__``, ``pkg://`` paths, and
    strings that are a claas_verl module name and nothing else."""
    targets = set()
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif (isinstance(node, ast.Call) and _called_name(node) in _IMPORT_CALLS and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            targets.update(_PKG_PATH.findall(node.value))
            if _MODULE_NAME.fullmatch(node.value):
                targets.add(node.value)
    return targets


def imported_names(path: Path) -> set[str]:
    return imported_names_in(path.read_text())


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


def test_string_imports_are_imports():
    """The layering rule cannot be dodged by naming a module in a string."""
    source = (
        "import importlib\n"
        "from importlib import import_module\n"
        "def f():\n"
        "    importlib.import_module('claas_verl.a')\n"
        "    import_module('claas_verl.b')\n"
        "    __import__('claas_verl.c')\n"
        "    for name in ('claas_verl.e', 'claas_verl.f.g'):\n"
        "        importlib.import_module(name)\n"
        "    return {'path': 'pkg://claas_verl.d.sampler', 'doc': 'run python -m claas_verl.tiny make DIR'}\n"
    )
    found = {t for t in imported_names_in(source) if t.startswith("claas_verl")}
    assert found == {"claas_verl.a", "claas_verl.b", "claas_verl.c", "claas_verl.d.sampler", "claas_verl.e",
                     "claas_verl.f.g"}


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


def test_only_the_edge_imports_the_tiny_models():
    """Production code (the math, the shared glue, both systems) never depends on the offline test models."""
    bad = sorted(f"{name} -> {t}" for name, targets in import_graph().items()
                 if name not in EDGE and not _under(name, (TINY,))
                 for t in targets if _under(t, (TINY,)))
    assert bad == [], "\n".join(bad)


def _yaml_strings(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _yaml_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _yaml_strings(value)
    elif isinstance(node, str):
        yield node


def test_no_recipe_loads_code_from_the_tiny_models():
    """A recipe's reward function, sampler or any other code path it names (a file path or ``pkg://`` module) lives
    with its system or in the shared glue, also for the tiny recipes."""
    bad = []
    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        for text in _yaml_strings(yaml.safe_load(path.read_text())):
            if re.search(r"claas_verl[./]tiny[./]\w+\.py|pkg://claas_verl\.tiny", text):
                bad.append(f"{path.relative_to(REPO)}: {text}")
    assert bad == [], "\n".join(bad)


def _third_party(path: Path) -> set[str]:
    """The top-level third-party packages ``path`` imports (stdlib, claas_verl and sibling scripts left out)."""
    local = {p.stem for p in path.parent.glob("*.py")}
    tops = {t.split(".")[0] for t in imported_names(path)}
    return {t for t in tops if t not in sys.stdlib_module_names and t != "claas_verl" and t not in local}


def test_each_layer_imports_only_its_third_party_packages():
    bad = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if _under(name, PURE):
            allowed = MATH_PACKAGES
        elif _under(name, SHARED):
            allowed = SHARED_PACKAGES
        elif _under(name, SYSTEMS):
            allowed = SYSTEM_PACKAGES
        else:
            allowed = EDGE_PACKAGES
        extra = _third_party(path) - allowed
        if extra:
            bad[name] = sorted(extra)
    assert bad == {}, f"third-party imports outside the layer's allow-list (tests/test_import_cycles.py): {bad}"

