"""One trainer job of a benchmark (``continual.py``, ``continual_claas.py``): a subprocess of this interpreter with
the venv first on PATH and a Ray cluster of its own, its whole output in a log file, chosen lines echoed.

Each job runs in a process group of its own, and :func:`stopping_jobs_on_signals` makes SIGTERM and SIGINT to the
benchmark stop every job's whole group (the trainer and the Ray cluster it started) before the benchmark exits.
Without it, a benchmark killed by ``kill``, ``timeout`` or a CI cancel left its trainer jobs training on. A
benchmark killed by SIGKILL cannot stop anything: each job runs under ``job_guard.py``, which stops its group
when the benchmark is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUARD = Path(__file__).resolve().with_name("job_guard.py")
STOP_GRACE_S = 15.0  # SIGTERM first (Ray's driver tears its cluster down), SIGKILL after this long

_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()
_stopping = threading.Event()


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
    with _live_lock:
        if _stopping.is_set():  # the benchmark is being stopped: start nothing new
            raise RuntimeError(f"{' '.join(cmd[1:4])} not started: the benchmark is stopping")
        # a session (and process group) of its own: stop_jobs() reaches everything the job started; the guard
        # leads it and stops it if this process dies without doing so
        guarded = [sys.executable, str(GUARD), "--parent", str(os.getpid()), "--", *cmd]
        proc = subprocess.Popen(guarded, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        _live.add(proc)
    try:
        with log_path.open("w") as log:
            for line in proc.stdout:
                log.write(line)
                shown = echo(line)
                if shown is not None:
                    print("   " + shown, flush=True)
        if proc.wait() != 0:
            tail = log_path.read_text().splitlines()[-40:]
            raise RuntimeError(f"{' '.join(cmd[1:4])} failed (exit {proc.returncode}); log {log_path}:\n"
                               + "\n".join(tail))
    finally:
        with _live_lock:
            _live.discard(proc)
        if proc.poll() is None:  # an error here (in echo, in writing the log) must not leave the job running
            _stop_groups([proc], STOP_GRACE_S)
            proc.wait()
    return time.time() - start


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the job's pid is its group id (start_new_session)


def _stop_groups(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every job's group, then SIGKILL to each group once its job exited or ``grace_s`` passed (the
    group's other processes too, even when the job itself has exited)."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(deadline - time.time(), 0.0))
        _signal_group(p, signal.SIGKILL)


def stop_jobs(grace_s: float = STOP_GRACE_S) -> int:
    """Stop every running job's process group and start no new job. Returns how many jobs were running."""
    _stopping.set()
    with _live_lock:
        procs = list(_live)
    _stop_groups(procs, grace_s)
    return len(procs)


@contextlib.contextmanager
def stopping_jobs_on_signals() -> Iterator[None]:
    """Within the block (main thread only), SIGTERM and SIGINT stop every job (:func:`stop_jobs`) and then end the
    benchmark: SIGINT as ``KeyboardInterrupt``, SIGTERM as ``SystemExit(143)``. Runs saved before stay saved."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        n = stop_jobs()
        print(f"\n=== {signal.Signals(signum).name}: stopped {n} running job(s); finished runs are saved, the same "
              "command resumes", file=sys.stderr, flush=True)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    _stopping.clear()
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
