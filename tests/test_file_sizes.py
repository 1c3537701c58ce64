"""Small files: no module of the package or of benchmarks/ grows past 600 lines (split it by job instead)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT = 600


@pytest.mark.parametrize("folder", ["claas_verl", "benchmarks"])
def test_no_module_over_the_limit(folder):
    root = REPO / folder
    long = {str(p.relative_to(REPO)): n for p in root.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > LIMIT}
    assert long == {}, f"modules over {LIMIT} lines: {long}"
