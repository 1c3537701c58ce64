"""A CLaaS training job with its chat API, started as a user starts it (``python -m claas_verl.main_claas``), for the
slow end-to-end tests: start it, wait for its API, stop it the way an operator does."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def start_job(cmd, env, log_path: Path) -> subprocess.Popen:
    """The job in its own session (a kill reaches all of it), output into ``log_path``."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_api(proc: subprocess.Popen, run_dir: Path, log_path: Path, timeout_s: float = 900) -> dict:
    """The job's ``service.json`` (address, keys) once the chat API is up; fails with the log's tail if it died."""
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "service.json").exists():
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, "the chat API did not come up"
        time.sleep(1)
    return json.loads((run_dir / "service.json").read_text())


def stop_job(proc: subprocess.Popen, log_path: Path) -> None:
    """SIGTERM to the driver: intake stops, the trainer drains and checkpoints, the job exits 0."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 0, log_path.read_text()[-4000:]
