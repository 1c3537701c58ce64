"""The staging that lets uid 65534 run a test file when the checkout lives in a folder only root can enter."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from unprivileged_stage import NOBODY, first_closed_folder, interpreter_for_nobody, stage_for_nobody, stage_root

REPO = Path(__file__).resolve().parents[2]
TEST_FILE = REPO / "tests" / "sandbox" / "test_sandbox_modes.py"


def test_first_closed_folder_names_the_folder_that_keeps_others_out(tmp_path):
    above = first_closed_folder(tmp_path.parent)  # pytest's own base folder may already be closed (0700)
    private = tmp_path / "private"
    (private / "checkout" / "tests").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    os.chmod(private, 0o700)
    assert first_closed_folder(private / "checkout" / "tests") == (above or private)
    os.chmod(private, 0o755)
    assert first_closed_folder(private / "checkout" / "tests") == above
    os.chmod(tmp_path, 0o700)
    assert first_closed_folder(private / "checkout" / "tests") == (above or tmp_path)


@pytest.fixture
def private_checkout():
    """A copy of the package and the sandbox test file inside a 0700 folder, as in ``mktemp -d`` or ``/root``.

    Its parent must be a folder uid 65534 can enter, the same condition under which the unprivileged suite itself
    can run (issue #60: it skips, naming the closed folder, only when no such folder exists)."""
    root = stage_root()
    if root is None:
        pytest.skip(f"no folder uid 65534 can enter: {first_closed_folder(Path(tempfile.gettempdir()))} "
                    "(from $TMPDIR) and /tmp, /var/tmp, /dev/shm are closed to others")
    outer = Path(tempfile.mkdtemp(dir=root))
    os.chmod(outer, 0o755)
    private = outer / "private"
    private.mkdir(mode=0o700)
    checkout = private / "checkout"
    shutil.copytree(REPO / "claas_verl", checkout / "claas_verl", ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "tests" / "sandbox").mkdir(parents=True)
    shutil.copy2(TEST_FILE, checkout / "tests" / "sandbox" / TEST_FILE.name)
    shutil.copy2(REPO / "pytest.ini", checkout / "pytest.ini")
    yield checkout
    shutil.rmtree(outer, ignore_errors=True)


def _as_nobody(python, pythonpath, cwd):
    setpriv = shutil.which("setpriv")
    return subprocess.run(
        [setpriv, *NOBODY, python, "-c", "import pytest, pyseccomp, claas_verl.sandbox; print('ok')"],
        capture_output=True, text=True, cwd=cwd, timeout=60,
        env={"PATH": os.defpath, "PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/"})


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="switches to uid 65534: needs root and setpriv (util-linux)")
def test_nobody_imports_the_stage_of_a_checkout_it_cannot_enter(private_checkout):
    python = interpreter_for_nobody(shutil.which("setpriv"))
    if python is None:
        pytest.skip("no interpreter of this version that uid 65534 can start (the unprivileged suite skips then too)")
    import pyseccomp
    import pytest as pytest_module
    # the unstaged way (the checkout and site-packages on PYTHONPATH) fails from a private checkout
    site_packages = {str(Path(m.__file__).resolve().parents[1 if m is pytest_module else 0])
                     for m in (pyseccomp, pytest_module)}
    unstaged = _as_nobody(python, os.pathsep.join([str(private_checkout), *sorted(site_packages)]), cwd="/")
    assert unstaged.returncode != 0 and "claas_verl" in unstaged.stderr, unstaged

    stage, staged_test = stage_for_nobody(private_checkout / "tests" / "sandbox" / TEST_FILE.name,
                                          private_checkout, stage_root(), extra_modules=("pyseccomp",))
    try:
        assert first_closed_folder(stage) is None
        assert staged_test == stage / "tests" / "sandbox" / TEST_FILE.name and staged_test.is_file()
        for folder, dirs, files in os.walk(stage):
            for name in dirs:
                assert os.stat(Path(folder) / name).st_mode & 0o005 == 0o005, Path(folder) / name
            for name in files:
                assert os.stat(Path(folder) / name).st_mode & 0o004, Path(folder) / name
        for top in ("claas_verl", "_pytest", "pytest", "pluggy", "omegaconf"):
            assert (stage / "site" / top).exists(), f"{top} was not staged"
        staged = _as_nobody(python, str(stage / "site"), cwd=stage)
        assert staged.returncode == 0 and staged.stdout.strip() == "ok", staged
    finally:
        shutil.rmtree(stage, ignore_errors=True)
