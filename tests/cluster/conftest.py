"""Fixtures of the cluster tests: Ray nodes of the test's own, and an interpreter without claas_verl installed.

Every node is started with ``ray start`` in a new session and a temp dir under the test's ``tmp_path``
(Ray records "the current cluster" in its temp dir; the default ``/tmp/ray`` would make every other
``ray.init()`` on the machine join it). Teardown signals only the processes of those sessions; it never runs
``ray stop``, which stops every Ray node on the machine.

``bare_python``: a virtualenv that sees every installed package of this interpreter except claas_verl.
Its site-packages is a folder of symlinks to this environment's entries, minus claas_verl's distribution
(its ``dist-info`` holds the ``verl.plugins`` entry point) and its editable-install hooks. So
``import claas_verl`` fails there and verl finds no claas_verl plugin: the code can only come from a Ray
``working_dir`` or ``PYTHONPATH``, and the CPU platform only from ``VERL_USE_EXTERNAL_MODULES``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# files planted into the submitted checkout that Ray must not upload
PLANTED = (".venv/lib/big.bin", "build/lib/x.py", "dist/claas_verl.whl", "claas_verl.egg-info/PKG-INFO",
           "outputs/2026-01-01/run.log", "runs/old/steps.jsonl", "wandb/run/x.wandb")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory) -> Path:
    """Path of a ``python`` that has every dependency of claas_verl but not claas_verl itself."""
    root = tmp_path_factory.mktemp("bare_env")
    farm = root / "site"
    farm.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if "claas_verl" in name:  # its package, dist-info (entry point) and editable-install hooks
            continue
        (farm / entry.name).symlink_to(entry)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "_deps.pth").write_text(f"import site; site.addsitedir({str(farm)!r})\n")
    # the `ray` command of this environment (what pip writes for ray's console script)
    ray_cli = venv / "bin" / "ray"
    ray_cli.write_text(f"#!{py}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    ray_cli.chmod(0o755)
    probe = subprocess.run(
        [py, "-c", "import importlib.metadata as m, importlib.util as u, verl; "
                   "print(u.find_spec('claas_verl'), [e.value for e in m.entry_points(group='verl.plugins')])"],
        cwd=root, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert probe.returncode == 0 and probe.stdout.split() == ["None", "[]"], probe.stdout + probe.stderr[-3000:]
    return py


class RayNodes:
    """``ray start`` nodes of one test (each in its own session and temp dir), stopped by :meth:`stop`."""

    def __init__(self, root: Path, python: Path):
        self.root, self.python = root, python
        self.home = root / "home"  # $HOME: the auth token file ~/.ray/auth_token of this test only
        self.home.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
        env.update(
            HOME=str(self.home),
            PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
            RAY_AUTH_MODE="token",
            PYTHONUNBUFFERED="1",
            RAY_raylet_start_wait_time_s="180",  # a loaded 2-core host can take a minute to start a raylet
            # Ray's memory monitor kills the newest worker when the MACHINE is above 95% memory; on this shared
            # host other processes' memory killed a tiny job that way (Ray's documented switch turns it off)
            RAY_memory_monitor_refresh_ms="0",
        )
        self.env = env
        self.sessions: list[int] = []
        # node temp dirs: short (Ray's socket paths under them must stay within AF_UNIX's 107 bytes)
        self.temp = Path(tempfile.mkdtemp(prefix="claas_ray_", dir="/tmp"))

    def sh(self, *cmd: str, cwd: Path | None = None, timeout: float = 300, check: bool = True):
        proc = subprocess.run(list(cmd), cwd=cwd or self.root, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        return proc

    def start(self, *args: str, timeout: float = 300) -> str:
        """``ray start ARGS`` in a new session; returns its output."""
        # Ray's dashboard agent listens on a FIXED default port (52365): a second node on the same host (another
        # test's, or the other node of a two-node cluster) fails to start its agent, and job submission then
        # answers "No available agent". Every node of the tests gets a free one.
        args = (*args, f"--dashboard-agent-listen-port={_free_port()}")
        proc = subprocess.Popen(["ray", "start", *args], cwd=self.root, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.sessions.append(proc.pid)  # session id == the leader's pid; every Ray daemon of the node inherits it
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-6000:]
        return out

    def _members(self) -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            state, sid = fields[0], int(fields[3])
            if sid in self.sessions and state != "Z":
                pids.append(int(stat.parent.name))
        return pids

    def stop(self, grace: float = 20.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self._members():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + grace
            while self._members() and time.time() < deadline:
                time.sleep(0.5)
        assert not self._members(), "Ray processes of this test survived SIGKILL"
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def ray_nodes(tmp_path, bare_python):
    nodes = RayNodes(tmp_path, bare_python)
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of this checkout's files (tracked and not ignored), plus the kinds of folders Ray must not upload."""
    dst = tmp_path / "checkout"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode == 0:
        for rel in filter(None, listed.stdout.decode().split("\0")):
            src = REPO / rel
            if src.is_file():
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst / rel)
    else:  # not a git checkout: copy without the folders .gitignore names
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".venv", "build", "dist", "*.egg-info", "outputs",
                                                                  "runs", "wandb", "__pycache__", ".git"))
    for planted in PLANTED:
        (dst / planted).parent.mkdir(parents=True, exist_ok=True)
        (dst / planted).write_bytes(b"0" * 1024)
    return dst


@pytest.fixture
def planted() -> tuple[str, ...]:
    """The files :func:`checkout` planted (relative paths)."""
    return PLANTED


@pytest.fixture
def free_port():
    return _free_port
