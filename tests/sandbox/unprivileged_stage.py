"""Give uid 65534 (``nobody``) a readable copy of what a test file needs, wherever the checkout lives.

A checkout (and its venv) may sit under a folder only root can enter: ``mktemp -d`` makes 0700 folders and
``/root`` is 0700 in most containers. A child started as ``nobody`` with the checkout and the venv's
``site-packages`` on ``PYTHONPATH`` then finds neither. :func:`stage_for_nobody` copies into a fresh folder that
``nobody`` can enter:

* the ``claas_verl`` package (Python files only) and the test file,
* every third-party top-level package that a collect-only run of the test file imports, plus the ones named in
  ``extra_modules`` (imported lazily by the tests' bodies),

and :func:`first_closed_folder` names the folder that keeps ``nobody`` out when no such place exists, so a test can
skip with that path instead of failing on where the checkout lives.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

NOBODY = ["--reuid=65534", "--regid=65534", "--clear-groups"]
STAGE_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")  # tried after tempfile.gettempdir()


def interpreter_for_nobody(setpriv: str) -> str | None:
    """This interpreter, or one of the same version, that uid 65534 can start inside a user namespace (a venv's
    interpreter may live under a folder only root can enter), or None."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (sys.executable, os.path.realpath(sys.executable), shutil.which(f"python{version}"),
                f"/usr/bin/python{version}"):
        if exe and subprocess.run([setpriv, *NOBODY, "unshare", "--user", "--map-root-user", exe, "-c",
                                   f"import sys; assert sys.version.startswith('{version}')"],
                                  capture_output=True).returncode == 0:
            return exe
    return None


def first_closed_folder(path: Path) -> Path | None:
    """The first folder from ``/`` down to ``path`` that others may not enter (no ``o+x``), or None."""
    path = Path(path).resolve()
    for folder in (*reversed(path.parents), path):
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def stage_root() -> Path | None:
    """A folder ``nobody`` can enter to stage in (``$TMPDIR`` first), or None."""
    for root in (tempfile.gettempdir(), *STAGE_ROOTS):
        if Path(root).is_dir() and first_closed_folder(Path(root)) is None:
            return Path(root)
    return None


def _imported_files(test_file: Path, repo: Path, extra_modules: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Every module file a collect-only pytest run of ``test_file`` (from ``repo``) loads, and that run's
    ``sys.path``."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "modules.json"
        probe = (
            "import json, sys, pytest\n"
            f"for name in {list(extra_modules)!r}: __import__(name)\n"
            "pytest.main(['--collect-only', '-q', '--noconftest', '-p', 'no:cacheprovider', sys.argv[1]])\n"
            "files = sorted({f for m in list(sys.modules.values()) if (f := getattr(m, '__file__', None))})\n"
            "open(sys.argv[2], 'w').write(json.dumps([files, sys.path]))\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, "-c", probe, str(test_file), str(out)], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=120)
        if not out.exists():
            raise RuntimeError(f"the import probe of {test_file} failed: {run.stdout[-1500:]}{run.stderr[-1500:]}")
        return json.loads(out.read_text())


def _top_level_sources(files: list[str], path: list[str], repo: Path) -> set[Path]:
    """The top-level package folder (or single-file module) of each third-party file: its ``sys.path`` entry plus
    the first part below it. The standard library and the checkout's own code are left out (``nobody``'s
    interpreter brings its own standard library; the package is copied on its own)."""
    stdlib = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    entries = sorted({Path(p).resolve() for p in path if p and Path(p).is_dir()},
                     key=lambda p: len(p.parts), reverse=True)  # deepest first: site-packages before its parents
    sources = set()
    for name in files:
        file = Path(name).resolve()
        own_code = any(file.is_relative_to(repo / own) for own in ("claas_verl", "tests"))
        standard = any(file.is_relative_to(s) for s in stdlib) and "site-packages" not in file.parts
        if own_code or standard:
            continue
        entry = next((e for e in entries if file.is_relative_to(e)), None)
        if entry is None:
            continue
        sources.add(entry / file.relative_to(entry).parts[0])
    return sources


def _readable_copy(source: Path, target: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    if source.is_dir():
        shutil.copytree(source, target, ignore=ignore, dirs_exist_ok=True)
    else:
        shutil.copy2(source, target)
    for folder, dirs, names in os.walk(target) if target.is_dir() else [(str(target.parent), [], [target.name])]:
        for name in dirs:
            os.chmod(Path(folder) / name, 0o755)
        for name in names:
            path = Path(folder) / name
            os.chmod(path, os.stat(path).st_mode | 0o444)


def stage_for_nobody(test_file: Path, repo: Path, root: Path,
                     extra_modules: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Copy ``claas_verl``, ``test_file`` (at its path relative to ``repo``), ``pytest.ini`` and every third-party
    package the test file imports into a new folder under ``root``; returns ``(stage, staged_test_file)``.

    The stage's ``site`` folder is the child's whole ``PYTHONPATH`` and the stage its working directory, so nothing
    the child reads lies under the checkout or the venv."""
    repo, test_file = Path(repo).resolve(), Path(test_file).resolve()
    stage = Path(tempfile.mkdtemp(prefix="claas_nobody_", dir=root))
    os.chmod(stage, 0o755)
    site = stage / "site"
    site.mkdir(mode=0o755)
    _readable_copy(repo / "claas_verl", site / "claas_verl")
    files, path = _imported_files(test_file, repo, extra_modules)
    for source in _top_level_sources(files, path, repo):
        _readable_copy(source, site / source.name)
    staged_test = stage / test_file.relative_to(repo)
    staged_test.parent.mkdir(parents=True, exist_ok=True)
    for folder in (stage, *staged_test.parents):
        if folder.is_relative_to(stage):
            os.chmod(folder, 0o755)
    _readable_copy(test_file, staged_test)
    if (repo / "pytest.ini").exists():
        _readable_copy(repo / "pytest.ini", stage / "pytest.ini")
    home = stage / "home"
    home.mkdir()
    os.chmod(home, 0o777)  # the child's HOME and pytest's basetemp
    return stage, staged_test
