"""benchmarks/bench_jobs.py: a benchmark stopped by a signal stops its trainer jobs and everything they started.

A trainer job stands in here as a Python process that starts a grandchild (as a job starts its Ray cluster) and
sleeps; the benchmark is a real subprocess that runs it through ``run_job`` and gets SIGTERM or SIGINT."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

JOB = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); "
       "open(sys.argv[1], 'w').write(f'{__import__(\"os\").getpid()} {p.pid}'); print('job started', flush=True); "
       "time.sleep(300)")

BENCHMARK = f"""
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from benchmarks.bench_jobs import job_env, run_job, stopping_jobs_on_signals

pidfile, log = sys.argv[1], Path(sys.argv[2])
cmd = [sys.executable, "-c", {JOB!r}, pidfile]
with stopping_jobs_on_signals(), ThreadPoolExecutor(max_workers=1) as pool:
    # two jobs, one at a time: the second must never start once the benchmark is stopping
    first = pool.submit(run_job, cmd, job_env(), log, lambda line: line.strip() or None)
    second = pool.submit(run_job, cmd + ["-second"], job_env(), log.with_suffix(".2"), lambda line: None)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; whoever reaps it is not this test's concern


@contextlib.contextmanager
def _benchmark_with_a_running_job(tmp_path):
    """The benchmark process, its job's pid and the job's child's pid, once the job has started; whatever is
    left of the three is killed afterwards, so that a failing test leaks no process."""
    pidfile = tmp_path / "pids"
    bench = subprocess.Popen([sys.executable, "-c", BENCHMARK, str(pidfile), str(tmp_path / "job.log")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert "job started" in bench.stdout.readline()
        pids = [int(p) for p in pidfile.read_text().split()]
        assert all(_alive(p) for p in pids)
        yield bench, pids
    finally:
        for p in [bench.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        bench.wait()


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.time() + within_s
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_benchmark_stops_its_jobs_and_their_children(tmp_path, sig):
    with _benchmark_with_a_running_job(tmp_path) as (bench, pids):
        assert os.getpgid(pids[0]) != os.getpgid(bench.pid)  # the job runs in a group of its own
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == (143 if sig == signal.SIGTERM else -signal.SIGINT) or \
            (sig == signal.SIGINT and bench.returncode == 130)
        assert "stopped 1 running job(s)" in err
        assert _gone(pids, within_s=10)
    assert not (tmp_path / "job.2").exists()  # the queued job was not started


def test_a_benchmark_killed_outright_still_leaves_no_job_running(tmp_path):
    """SIGKILL cannot be caught: the job's guard (benchmarks/job_guard.py) sees its parent gone and stops the
    job's whole group."""
    with _benchmark_with_a_running_job(tmp_path) as (bench, pids):
        bench.kill()
        bench.wait(timeout=10)
        assert _gone(pids, within_s=30)


def test_a_finished_job_returns_its_seconds_and_a_failed_one_its_log_tail(tmp_path):
    from benchmarks.bench_jobs import job_env, run_job

    seen = []
    secs = run_job([sys.executable, "-c", "print('a'); print('b')"], job_env(), tmp_path / "ok.log",
                   lambda line: seen.append(line.strip()) or None)
    assert secs > 0 and seen == ["a", "b"] and (tmp_path / "ok.log").read_text() == "a\nb\n"
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\).*\n.*last words"):
        run_job([sys.executable, "-c", "print('last words'); raise SystemExit(3)"], job_env(), tmp_path / "bad.log",
                lambda line: None)


def test_the_guard_passes_the_jobs_exit_status_and_output(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "job_guard.py"), "--parent", str(os.getpid()),
                          "--", sys.executable, "-c", "print('from the job'); raise SystemExit(7)"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 7 and out.stdout == "from the job\n"
    killed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "job_guard.py"), "--parent",
                             str(os.getpid()), "--", "sh", "-c", "kill -TERM $$"], timeout=30)
    assert killed.returncode == 128 + signal.SIGTERM
