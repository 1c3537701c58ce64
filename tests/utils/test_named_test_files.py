"""Every test file the package's docstrings, the recipes, the README, the docs site and the Makefile name exists:
a reader sent to a test that is not there cannot check the claim it backs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*(REPO / "claas_verl").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"),
           *(REPO / "examples").rglob("*"), *(REPO / "recipes").rglob("*.yaml"), *(REPO / "third_party").rglob("*"),
           *(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "Makefile"]
NAMED = re.compile(r"tests/[A-Za-z0-9_/]+\.py")


def missing_test_files(paths, root: Path = REPO) -> dict[str, list[str]]:
    """``{named test file: [files naming it]}`` for each named file absent under ``root``."""
    missing: dict[str, list[str]] = {}
    for path in paths:
        if path.is_file() and path.suffix in (".py", ".md", ".yaml", ".sh", ".txt", ""):
            for name in NAMED.findall(path.read_text(errors="replace")):
                if not (root / name).is_file():
                    missing.setdefault(name, []).append(str(path))
    return missing


def test_every_named_test_file_exists():
    missing = missing_test_files(SOURCES)
    assert not missing, f"test files named but absent (fix the reference or add the test): {missing}"


def test_the_scan_finds_a_reference_to_a_missing_file(tmp_path):
    doc = tmp_path / "mod.py"
    doc.write_text('"""checked by tests/claas/test_lora_versions.py and tests/verl_ext/test_nothing_here.py"""\n')
    assert missing_test_files([doc]) == {"tests/verl_ext/test_nothing_here.py": [str(doc)]}
