"""Sandboxed execution of untrusted per-scenario Python graders (issue #8 (b), SPEC A.1.4).

IH-Challenge scenarios ship Python source defining ``grade_output_correct``.
That code runs here in a separate process:

- a *zygote* (``python -I -S _grader_worker.py``: isolated mode, no site-packages,
  empty environment so no inherited secrets, private temp cwd) is started once per
  :class:`GraderSandbox` and forks one child per call;
- the child sets CPU-time / address-space / file-size / process rlimits, replaces
  the socket constructors and installs an irremovable audit hook that rejects
  sockets, process spawning, ctypes and file writes, then runs the grader;
- the zygote enforces the wall-clock limit (SIGKILL of the child); the parent
  enforces ``timeout_s + margin`` on the zygote and recycles it if it hangs or dies.

Any failure (exception, syntax error, timeout, memory or CPU limit, non-bool
return, blocked network/file access) raises :class:`GraderError`, which
:func:`claas_verl.envs.base.grade_response` turns into reward None.

Overhead: one fork of a small stdlib interpreter plus two pipe round-trips per
call (about a millisecond or two; run ``python -m claas_verl.envs.sandbox`` to
measure), against ~0.5 s to start a new interpreter per call.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from queue import Queue

from claas_verl.envs.base import GraderError, Verdict

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_grader_worker.py")
_PARENT_MARGIN_S = 5.0  # extra wall time granted to the zygote itself (fork + reap) before it is presumed hung


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. ``timeout_s``: wall clock; ``cpu_s``: RLIMIT_CPU; ``memory_mb``: RLIMIT_AS."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"SandboxLimits.timeout_s must be > 0, got {self.timeout_s}")
        if not (isinstance(self.cpu_s, int) and self.cpu_s >= 1):
            raise ValueError(f"SandboxLimits.cpu_s must be an int >= 1, got {self.cpu_s!r}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise ValueError(
                f"SandboxLimits.memory_mb must be an int >= 64 (the interpreter needs it), got {self.memory_mb!r}"
            )


DEFAULT_LIMITS = SandboxLimits()


def _clean_env() -> dict[str, str]:
    # Nothing from the parent environment (API keys, tokens, proxies) reaches the grader.
    return {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


class GraderSandbox:
    """One zygote process; ``run`` is thread-safe (calls are serialised). Use :class:`GraderPool` for parallelism."""

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS):
        self.limits = limits
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._cwd: str | None = None
        self.restarts = 0  # zygote (re)starts after the first, i.e. recycles after a hang/death

    def _start(self) -> None:
        self._cwd = tempfile.mkdtemp(prefix="claas_grader_")
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _WORKER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=_clean_env(), cwd=self._cwd, close_fds=True, start_new_session=True,
        )

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                f.close()
        if self._cwd is not None:
            shutil.rmtree(self._cwd, ignore_errors=True)
            self._cwd = None

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd, buf = self._proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("grader zygote did not answer in time")
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError("grader zygote exited")
            buf += chunk
        return buf

    def run(self, source: str, output: str, context: str = "") -> bool:
        """Run ``grade_output_correct`` from ``source`` on ``output``; True/False, or raise :class:`GraderError`."""
        req = json.dumps({
            "source": source, "output": output, "context": context, "timeout_s": self.limits.timeout_s,
            "cpu_s": self.limits.cpu_s, "memory_mb": self.limits.memory_mb,
        }).encode()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self._kill()
                    self.restarts += 1
                self._start()
            try:
                self._proc.stdin.write(struct.pack(">I", len(req)) + req)
                self._proc.stdin.flush()
                deadline = time.monotonic() + self.limits.timeout_s + _PARENT_MARGIN_S
                n = struct.unpack(">I", self._read_exact(4, deadline))[0]
                reply = json.loads(self._read_exact(n, deadline).decode())
            except (OSError, EOFError, TimeoutError, ValueError) as e:
                self._kill()  # recycle: the next call starts a fresh zygote
                self.restarts += 1
                raise GraderError(f"grader sandbox failed: {type(e).__name__}: {e}") from e
        if not reply.get("ok"):
            raise GraderError(str(reply.get("error", "unknown grader error")))
        return bool(reply["value"])

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort only
            pass


class GraderPool:
    """``n_workers`` sandboxes; ``run`` borrows a free one, so up to n graders run in parallel."""

    def __init__(self, n_workers: int = 1, limits: SandboxLimits = DEFAULT_LIMITS):
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        self.limits = limits
        self._all = [GraderSandbox(limits) for _ in range(n_workers)]
        self._free: Queue[GraderSandbox] = Queue()
        for sb in self._all:
            self._free.put(sb)

    def run(self, source: str, output: str, context: str = "") -> bool:
        sb = self._free.get()
        try:
            return sb.run(source, output, context)
        finally:
            self._free.put(sb)

    @property
    def restarts(self) -> int:
        return sum(sb.restarts for sb in self._all)

    def close(self) -> None:
        for sb in self._all:
            sb.close()


_SHARED: dict[tuple[SandboxLimits, int], GraderPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(limits: SandboxLimits = DEFAULT_LIMITS, n_workers: int = 1) -> GraderPool:
    """Process-wide pool per (limits, n_workers), created lazily (so scenarios pickled to Ray workers work)."""
    key = (limits, n_workers)
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        if pool is None:
            pool = _SHARED[key] = GraderPool(n_workers, limits)
        return pool


@atexit.register
def _close_shared() -> None:
    for pool in _SHARED.values():
        pool.close()


@dataclass(frozen=True)
class SandboxedVerifier:
    """A :class:`~claas_verl.envs.base.Verifier` running grader ``source`` in the process-wide sandbox pool.

    Holds only plain data (picklable); the pool is looked up per process. ``fail_feedback``
    is the feedback text on a failed step (the graders return a bare bool).
    """

    source: str
    fail_feedback: str | None = None
    limits: SandboxLimits = DEFAULT_LIMITS
    n_workers: int = 1

    def __call__(self, visible_text: str, user_context: str) -> Verdict:
        passed = shared_pool(self.limits, self.n_workers).run(self.source, visible_text, user_context)
        return Verdict(passed=True) if passed else Verdict(passed=False, feedback=self.fail_feedback)


def _benchmark(n: int = 200) -> None:
    src = "def grade_output_correct(output):\n    return 'secret' not in output.lower()\n"
    sb = GraderSandbox()
    t0 = time.perf_counter()
    sb.run(src, "hello")
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        sb.run(src, f"reply {i}")
    per_call = (time.perf_counter() - t0) / n
    sb.close()
    t0 = time.perf_counter()
    for _ in range(5):
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], env=_clean_env(), check=True)
    fresh = (time.perf_counter() - t0) / 5
    print(f"first call (zygote start) {t_first * 1e3:.1f} ms; per call {per_call * 1e3:.2f} ms over {n} calls; "
          f"a bare fresh interpreter costs {fresh * 1e3:.1f} ms")


if __name__ == "__main__":
    _benchmark()
