"""Runs one benchmark job and stops it when the benchmark that started it is gone, even by SIGKILL.

    python benchmarks/job_guard.py --parent PID -- CMD...

``bench_jobs.run_job`` starts this guard as the leader of a new process group, and the guard starts CMD in that
group. A benchmark that gets SIGTERM or Ctrl-C stops its jobs itself (``bench_jobs.stop_jobs``); one killed with
SIGKILL (``kill -9``, the OOM killer) cannot, and its jobs would train on unseen. The guard checks once a second
that the benchmark (PID) is still its parent; when it is not, it sends SIGTERM to the whole group (the trainer and
the Ray cluster it started) and SIGKILL after a grace period. It ignores SIGTERM itself, so that a stop sent to
the group ends CMD and the guard exits with CMD's status. Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys

POLL_S = 1.0
GRACE_S = 15.0


def exit_status(returncode: int) -> int:
    """CMD's status as a shell reports it: 128 + N when a signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def stop_group(child: subprocess.Popen, grace_s: float) -> None:
    os.killpg(0, signal.SIGTERM)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)  # the group's other processes, and this guard


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parent", type=int, required=True, help="the benchmark's pid")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the job's command")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command after --")
    child = subprocess.Popen(cmd)
    # after the start: an ignored signal would be inherited by CMD, which must still end on SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            return exit_status(child.wait(timeout=POLL_S))
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != args.parent:  # reparented: the benchmark is gone
            with contextlib.suppress(OSError):  # our output went to the benchmark: the pipe is likely broken
                print(f"[job_guard] the benchmark (pid {args.parent}) is gone: stopping the job", file=sys.stderr,
                      flush=True)
            stop_group(child, GRACE_S)


if __name__ == "__main__":
    sys.exit(main())
