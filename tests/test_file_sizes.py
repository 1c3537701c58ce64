"""Small files: no module of the package grows past 600 lines (split it by job instead)."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "claas_verl"
LIMIT = 600


def test_no_module_over_the_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > LIMIT}
    assert long == {}, f"modules over {LIMIT} lines: {long}"
