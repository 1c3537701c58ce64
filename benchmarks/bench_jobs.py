"""One trainer job of a benchmark (``continual.py``, ``continual_claas.py``): a subprocess of this interpreter with
the venv first on PATH and a Ray cluster of its own, its whole output in a log file, chosen lines echoed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def job_env(**extra: str) -> dict:
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1", **extra)
    # Start a cluster of our own unless the caller named one: never join another job's cluster by accident
    # (a `ray start` on this node leaves its address where a plain ray.init() would find it).
    env.setdefault("RAY_ADDRESS", "local")
    return env


def tagged(name: str, echo: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """``echo`` with the run's name in front, so that the lines of jobs running side by side stay attributable."""
    def tag(line: str) -> str | None:
        shown = echo(line)
        return None if shown is None else f"[{name}] {shown}"
    return tag


def run_job(cmd: list[str], env: dict, log_path: Path, echo: Callable[[str], str | None]) -> float:
    """Run ``cmd`` in the repository root; every output line goes to ``log_path`` and ``echo(line)``, when not
    None, to stdout. Returns the wall seconds; a non-zero exit raises RuntimeError with the log's last 40 lines."""
    start = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            shown = echo(line)
            if shown is not None:
                print("   " + shown, flush=True)
        if proc.wait() != 0:
            tail = log_path.read_text().splitlines()[-40:]
            raise RuntimeError(f"{' '.join(cmd[1:4])} failed (exit {proc.returncode}); log {log_path}:\n"
                               + "\n".join(tail))
    return time.time() - start
