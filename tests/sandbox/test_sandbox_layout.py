"""The zygote's parts, loaded by path outside the venv: present, in dependency order, hidden from snippets."""

import ast
from pathlib import Path

import claas_verl.sandbox as sandbox_pkg

SANDBOX = Path(sandbox_pkg.__file__).parent


def _parts() -> tuple[str, ...]:
    tree = ast.parse((SANDBOX / "_zygote.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_PARTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("_zygote.py defines no _PARTS")


def _all_imports(text: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _bare_imports(path: Path) -> set[str]:
    """The zygote parts a zygote file imports (by bare name: they are not on any search path)."""
    return {n for n in _all_imports(path.read_text()) if (SANDBOX / f"{n}.py").exists()}


def test_parts_are_loaded_after_what_they_import():
    parts = _parts()
    for i, name in enumerate(parts):
        assert (SANDBOX / f"{name}.py").is_file(), name
        assert _bare_imports(SANDBOX / f"{name}.py") <= set(parts[:i]), f"{name} imports a part loaded after it"
    assert _bare_imports(SANDBOX / "_zygote.py") <= set(parts)


def test_parts_are_hidden_from_assertion_snippets():
    # the checker resolves a snippet's free names against sys.modules entries that do not start with "_"
    assert all(name.startswith("_") for name in _parts())


def test_parts_import_nothing_from_the_venv():
    for name in (*_parts(), "_zygote"):
        text = (SANDBOX / f"{name}.py").read_text()
        assert "claas_verl" not in {n.split(".")[0] for n in _all_imports(text)}, name

