"""OS-level sandbox for untrusted code: IH-Challenge graders and model-written programs (issues 8 (b), 13).

Two kinds of untrusted code run here, never in the trainer's process: per-scenario graders
(``grade_output_correct``, SPEC A.1.4) and the code domain's programs run against test cases.

What a call gets (see :mod:`claas_verl.envs._grader_worker` for the mechanics)
--------------------------------------------------------------------------------
Each :class:`GraderSandbox` starts one *zygote* (``python -I -S``: no site-packages, empty environment) under
``unshare --net --pid --ipc --fork --mount --mount-proc`` (as root; ``--user --map-root-user`` is added otherwise),
which keeps one spare child forked and jailed ahead of each call (forked while the previous call runs) by a
fork server that never held anything of a call. The child, before it reads anything of the call:

- lives in a network namespace with no usable interface and a PID namespace where it sees no other process;
- ``chroot``\\ s into an empty read-only directory: no file of the host (no ``/proc/<pid>/environ``, no
  ``/etc``, no ``/dev``) is visible, and only the modules the zygote preloaded can be imported;
- runs as ``nobody`` (uid/gid 65534) when the trainer runs as root, or without any capability as root of an
  unprivileged user namespace, with ``no_new_privs``;
- has a seccomp *allow-list* (libseccomp through ``pyseccomp``, ``_grader_worker._ALLOW``): memory, reads of
  its own descriptors, read-only opens, clocks, signals to itself, exit. Everything else fails (fork/clone/
  exec, sockets, write-opens, ptrace, signals to other processes, ``prctl``, the new mount API, and whatever
  a later kernel adds), so a call cannot touch the spare that waits to serve the next one, nor clear its
  parent-death signal;
- holds exactly four descriptors: ``/dev/null`` on 0 and 2, a stdout pipe on 1 (dropped for graders,
  compared for programs) and a result pipe created for this call on 3;
- has rlimits on CPU seconds, address space, file size (0), processes (0), descriptors and core dumps;
- is killed with its whole process group at the wall-clock limit, or when its output exceeds
  ``max_output_bytes``.

Verdicts cannot be forged across calls or shifted: every call has its own result pipe and a random nonce, the
zygote accepts one length-prefixed JSON frame carrying that nonce, and the parent accepts only a zygote reply
echoing the request nonce. A trusted-side failure (a dead or hung zygote, a bad zygote frame, a nonce
mismatch, a jail that could not be set up) is a *sandbox failure*: the call raises :class:`GraderError`
(reward None, SPEC A.1.4), ``stats.sandbox_failures`` counts it, and the zygote is recycled so the next call
starts clean. A malformed or foreign frame written by the code itself is that code's failure
(``stats.forged_frames``): reward None for a grader, 0.0 for a program, so a program cannot turn a wrong
answer into a dropped sample. Whatever a call's code does once it was handed over (a real-time signal, a
crash, closing its pipes and sleeping) is that code's failure, bounded by the call's own wall clock; only a
jail that could not be set up is a sandbox failure. :meth:`GraderSandbox.run` raises nothing but
:class:`GraderError` once the sandbox is up. A call's process is forked from the fork server, whose memory
never held a request or a reply: no call can read another call's code, inputs, verdict or output.
:meth:`GraderSandbox.close` kills every process a call started (the zygote's namespace, or the parent-death
signal the jail cannot clear).

Where the kernel refuses namespaces, or ``pyseccomp``/libseccomp is missing, a sandbox refuses to start
(:class:`SandboxUnavailable`) unless ``SandboxLimits(allow_weak_isolation=True)`` (recipe:
``+claas.env.kwargs.sandbox.allow_weak_isolation=true``) opts in; it then runs with what is left (chroot, uid drop,
seccomp, rlimits, as available) and logs a warning at every zygote start.

Graders
-------
``GraderSandbox.run(source, output, context) -> bool``: ``source`` defines ``grade_output_correct(output)``
or ``(output, user_context)`` returning a bool. Any failure (exception, timeout, CPU/memory/output limit,
non-bool, blocked syscall, sandbox failure) raises :class:`GraderError`.
:class:`GraderPool` holds ``n_workers`` sandboxes (``run`` from many threads, or ``map`` to grade a batch in
parallel); :class:`SandboxedVerifier` is the picklable scenario verifier using the process-wide pool.

Programs (the code domain)
--------------------------
``run_program(source, tests, timeout_s=5.0, *, limits=None, pool=None) -> ProgramResult``

``tests`` is a sequence of

- :class:`IOTest` ``(stdin, expected_stdout)``: the program runs as ``__main__`` with ``stdin`` on
  ``sys.stdin``; the zygote captures its stdout and the *parent* compares it with ``expected_stdout``
  (trailing white space of lines and trailing blank lines ignored). One jailed process per test.
- :class:`CallTest` ``(fn, args, expected, atol=0.0)``: the program's module is executed (``__name__`` is
  ``"solution"``), then ``fn(*args)`` is called; the return value goes back as JSON and the parent compares
  it with ``expected`` (after the same JSON round trip: tuples compare equal to lists; floats within
  ``atol``). The expected values never enter the jail, so a program cannot read them.
- ``str``: an assertion snippet (MBPP's ``assert f(1) == 2``, loops, ``try``/``except`` included). It runs
  in a second jailed process, never in the program's: names that are neither builtins nor preloaded
  modules are looked up in the program, whose functions and objects the snippet calls remotely; values
  come back as plain data (None, bool, numbers, str, bytes, tuple, list, dict, set; subclasses as their
  base type), so every comparison runs on built-in values the program cannot override, and the expected
  values never enter the program's process. An object that is not plain data can be called, indexed or
  iterated but not compared or truth-tested (the test fails, naming why). A program's function that
  shadows a builtin or a module name is not reachable from a snippet.

All call tests of one ``run_program`` share one jailed process and the ``timeout_s`` budget, and so do all
assertion tests (with their checker process); each IO test has its own.
``GraderPool(n).run_programs([(source, tests), ...])`` runs many programs n at a time (evaluation sets).
:class:`ProgramResult` has ``status`` (``passed``, ``failed``, ``timeout``, ``sandbox_error``), ``passed`` /
``total`` test counts, per-test ``details`` and ``reward``: 1.0 when every test passed, 0.0 otherwise, None on
a sandbox failure (SPEC A.1.4: never trained on).
A program that crashes, times out or prints too much fails its tests (reward 0.0): that is the model's fault.

Throughput: ``python benchmarks/bench_sandbox.py`` prints graders/s per pool size and the per-call overhead.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import secrets
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from queue import Queue
from typing import Any

from claas_verl.envs.base import GraderError, Verdict

logger = logging.getLogger(__name__)

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_grader_worker.py")
# wall time granted to the zygote beyond the call's own limit before it is presumed hung: up to
# _grader_worker._READY_TIMEOUT_S (10 s) waiting for a spare that is still jailing itself, plus reaping
_PARENT_MARGIN_S = 15.0
_START_TIMEOUT_S = 60.0
_UNSHARE_ROOT = ("--net", "--pid", "--ipc", "--fork", "--mount", "--mount-proc", "--kill-child")
_UNSHARE_USER = ("--user", "--map-root-user", *_UNSHARE_ROOT)


class SandboxUnavailable(RuntimeError):
    """The kernel or the environment cannot give the isolation untrusted code needs, and no opt-in was set."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits and the isolation policy.

    ``timeout_s``: wall clock per jailed process; ``cpu_s``: RLIMIT_CPU; ``memory_mb``: RLIMIT_AS;
    ``max_output_bytes``: result frame / captured stdout; ``allow_weak_isolation``: run even where
    namespaces or seccomp are unavailable (logged as a warning), instead of refusing.
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20
    allow_weak_isolation: bool = False

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"SandboxLimits.timeout_s must be > 0, got {self.timeout_s!r}")
        if not (isinstance(self.cpu_s, int) and self.cpu_s >= 1):
            raise ValueError(f"SandboxLimits.cpu_s must be an int >= 1, got {self.cpu_s!r}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise ValueError(
                f"SandboxLimits.memory_mb must be an int >= 64 (the interpreter needs it), got {self.memory_mb!r}"
            )
        if not (isinstance(self.max_output_bytes, int) and self.max_output_bytes >= 4096):
            raise ValueError(f"SandboxLimits.max_output_bytes must be an int >= 4096, got {self.max_output_bytes!r}")
        if not isinstance(self.allow_weak_isolation, bool):
            raise ValueError(f"SandboxLimits.allow_weak_isolation must be a bool, got {self.allow_weak_isolation!r}")


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class IsolationSupport:
    """What this machine allows. ``unshare_args``: the namespace flags that worked (empty: none)."""

    unshare_args: tuple[str, ...]
    seccomp_path: str | None
    root: bool
    detail: str = ""

    @property
    def namespaces(self) -> bool:
        return bool(self.unshare_args)

    @property
    def strong(self) -> bool:
        return self.namespaces and self.seccomp_path is not None

    def missing(self) -> list[str]:
        out = []
        if not self.namespaces:
            out.append(f"network/PID/mount namespaces ({self.detail or 'unshare refused'})")
        if self.seccomp_path is None:
            out.append("seccomp (pip install pyseccomp; needs libseccomp.so.2)")
        return out


def _find_seccomp() -> str | None:
    try:
        import pyseccomp
    except Exception:  # noqa: BLE001 - missing module or missing libseccomp.so: no seccomp
        return None
    return os.path.abspath(pyseccomp.__file__)


@lru_cache(maxsize=1)
def probe_isolation() -> IsolationSupport:
    """Try the namespaces once per process (``unshare ... true``); find pyseccomp. Never raises."""
    root = os.geteuid() == 0
    seccomp = _find_seccomp()
    unshare = shutil.which("unshare")
    if unshare is None:
        return IsolationSupport((), seccomp, root, "no unshare binary (util-linux)")
    detail = ""
    for args in ((_UNSHARE_ROOT, _UNSHARE_USER) if root else (_UNSHARE_USER,)):
        try:
            r = subprocess.run([unshare, *args, "true"], capture_output=True, timeout=30, env=_clean_env())
        except (OSError, subprocess.SubprocessError) as e:
            detail = f"{type(e).__name__}: {e}"
            continue
        if r.returncode == 0:
            return IsolationSupport((unshare, *args), seccomp, root)
        detail = r.stderr.decode(errors="replace").strip()[:300]
    return IsolationSupport((), seccomp, root, detail)


def require_isolation(limits: SandboxLimits = DEFAULT_LIMITS,
                      isolation: IsolationSupport | None = None) -> IsolationSupport:
    """The machine's isolation support; :class:`SandboxUnavailable` when it is weak and ``limits`` did not opt in."""
    iso = isolation if isolation is not None else probe_isolation()
    if not iso.strong and not limits.allow_weak_isolation:
        raise SandboxUnavailable(
            "refusing to run untrusted code: this machine lacks " + "; ".join(iso.missing())
            + ". Fix the machine (run as root or allow unprivileged user namespaces; install pyseccomp), or "
            "accept weaker isolation explicitly with SandboxLimits(allow_weak_isolation=True) "
            "(recipe: +claas.env.kwargs.sandbox.allow_weak_isolation=true)."
        )
    return iso


def _clean_env() -> dict[str, str]:
    # Nothing from the parent environment (API keys, tokens, proxies) reaches the zygote.
    return {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass
class SandboxStats:
    """Counters of one sandbox (or a pool's sum). ``sandbox_failures``: protocol/setup failures (reward None)."""

    calls: int = 0
    code_errors: int = 0  # the untrusted code failed: exception, timeout, limit, non-bool, forged frame
    forged_frames: int = 0  # of which: the code wrote a malformed or foreign frame on its result pipe
    sandbox_failures: int = 0  # the trusted side failed: zygote/protocol/jail setup (reward None)
    restarts: int = 0

    def __add__(self, other: SandboxStats) -> SandboxStats:
        names = ("calls", "code_errors", "forged_frames", "sandbox_failures", "restarts")
        return SandboxStats(*(getattr(self, f) + getattr(other, f) for f in names))


class _SandboxFailure(Exception):
    pass


class GraderSandbox:
    """One zygote (one set of namespaces); calls are serialised. Use :class:`GraderPool` for parallelism.

    ``isolation``: what to assume the machine allows (default: :func:`probe_isolation`); tests pass a
    weaker :class:`IsolationSupport` to force the refusal and weak-isolation paths.
    """

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS, isolation: IsolationSupport | None = None):
        self.limits = limits
        self.isolation = require_isolation(limits, isolation)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._root: str | None = None
        self._started_once = False
        self.stats = SandboxStats()

    @property
    def restarts(self) -> int:
        return self.stats.restarts

    # -- zygote lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        iso = self.isolation
        if not iso.strong:
            logger.warning(
                "GRADER SANDBOX RUNS WITH WEAK ISOLATION (allow_weak_isolation=True): missing %s. Untrusted "
                "graders/programs may reach the network, other processes or files.", "; ".join(iso.missing()))
        can_chroot = iso.root or iso.namespaces  # CAP_SYS_CHROOT: real root, or root of the new user namespace
        self._root = tempfile.mkdtemp(prefix="claas_jail_") if can_chroot else None
        if self._root is not None:
            os.chmod(self._root, 0o555)
        cfg = {"root": self._root, "drop_uid": iso.root, "pyseccomp": iso.seccomp_path,
               "cpu_s": self.limits.cpu_s, "memory_mb": self.limits.memory_mb}
        cmd = [*iso.unshare_args, sys.executable, "-I", "-S", _WORKER, json.dumps(cfg)]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=_clean_env(), cwd=self._root or "/", close_fds=True, start_new_session=True,
        )
        if self._started_once:
            self.stats.restarts += 1
        self._started_once = True
        hello = self._read_frame(time.monotonic() + _START_TIMEOUT_S)
        if not hello.get("ready"):
            raise _SandboxFailure(f"zygote did not start: {hello}")
        if iso.seccomp_path is not None and not hello.get("seccomp"):
            raise _SandboxFailure("zygote could not build the seccomp filter")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, 9)  # the unshare process, the zygote (PID 1 of its namespace) and children
            except (ProcessLookupError, PermissionError):
                pass
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                f.close()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd, buf = self._proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _SandboxFailure("zygote did not answer in time")
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise _SandboxFailure("zygote exited")
            buf += chunk
        return buf

    def _read_frame(self, deadline: float) -> dict:
        n = struct.unpack(">I", self._read_exact(4, deadline))[0]
        if n > 8 * self.limits.max_output_bytes + (1 << 16):  # JSON escaping grows text up to 6x
            raise _SandboxFailure(f"zygote frame of {n} bytes exceeds the output limit")
        reply = json.loads(self._read_exact(n, deadline).decode())
        if not isinstance(reply, dict):
            raise _SandboxFailure("zygote frame is not an object")
        return reply

    def _call(self, req: dict[str, Any]) -> dict:
        """One request -> the zygote's validated reply. Raises only :class:`GraderError` (sandbox failures counted)."""
        nonce = secrets.token_hex(16)
        lim = self.limits
        if req.get("mode") == "assert":  # the program and the assertions in two processes (_jail_rpc)
            parts = [{"kind": "program", "mode": "serve", "source": req["source"]},
                     {"kind": "program", "mode": "check", "tests": [t["code"] for t in req["tests"]], "nonce": nonce}]
        else:
            parts = [{**req, "nonce": nonce}]
        header = json.dumps({"nonce": nonce, "kind": req["kind"], "mode": req.get("mode"), "parts": len(parts),
                             "timeout_s": lim.timeout_s, "max_output_bytes": lim.max_output_bytes}).encode()
        frame = struct.pack(">I", len(header)) + header
        for part in parts:
            payload = json.dumps(part).encode()
            frame += struct.pack(">I", len(payload)) + payload
        with self._lock:
            self.stats.calls += 1
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._kill()
                    self._start()
                self._proc.stdin.write(frame)
                self._proc.stdin.flush()
                reply = self._read_frame(time.monotonic() + lim.timeout_s + _PARENT_MARGIN_S)
                if reply.get("nonce") != nonce:
                    raise _SandboxFailure("zygote reply carries another call's nonce")
                if not isinstance(reply.get("ok"), bool):
                    raise _SandboxFailure("zygote reply has no 'ok' flag")
            except Exception as e:  # noqa: BLE001 - any protocol error: recycle, reward None, never crash the run
                self._kill()
                self.stats.sandbox_failures += 1
                logger.warning("grader sandbox failure (zygote recycled): %s: %s", type(e).__name__, e)
                raise GraderError(f"grader sandbox failed: {type(e).__name__}: {e}") from e
            if not reply["ok"]:
                if reply.get("sandbox_failure"):
                    self.stats.sandbox_failures += 1
                else:
                    self.stats.code_errors += 1
                    self.stats.forged_frames += bool(reply.get("forged"))
            return reply

    # -- public ----------------------------------------------------------------------------------
    def run(self, source: str, output: str, context: str = "") -> bool:
        """Run ``grade_output_correct`` from ``source`` on ``output``; True/False, or raise :class:`GraderError`."""
        reply = self._call({"kind": "grade", "source": str(source), "output": str(output), "context": str(context)})
        if not reply["ok"]:
            raise GraderError(str(reply.get("error", "unknown grader error")))
        value = reply.get("value")
        if not isinstance(value, bool):
            with self._lock:
                self.stats.sandbox_failures += 1
            raise GraderError("grader sandbox returned a verdict that is not a bool")
        return value

    def run_program(self, source: str, tests: Sequence[Any]) -> ProgramResult:
        """Run ``source`` against ``tests`` (see the module docstring); never raises for a bad program."""
        return _run_program_on(self.run_raw_program, source, tests)

    def run_raw_program(self, req: dict[str, Any]) -> dict:
        return self._call({"kind": "program", **req})

    def start(self) -> None:
        """Start the zygote now (else on the first call); raises :class:`GraderError` if it cannot start."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                try:
                    self._kill()
                    self._start()
                except Exception as e:  # noqa: BLE001
                    self._kill()
                    self.stats.sandbox_failures += 1
                    raise GraderError(f"grader sandbox failed to start: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __enter__(self) -> GraderSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort only
            pass


class GraderPool:
    """``n_workers`` sandboxes; ``run`` borrows a free one, so up to n calls run in parallel (one per thread)."""

    def __init__(self, n_workers: int = 1, limits: SandboxLimits = DEFAULT_LIMITS,
                 isolation: IsolationSupport | None = None):
        if not (isinstance(n_workers, int) and n_workers >= 1):
            raise ValueError(f"n_workers must be an int >= 1, got {n_workers!r}")
        self.limits = limits
        self._all = [GraderSandbox(limits, isolation) for _ in range(n_workers)]
        self._free: Queue[GraderSandbox] = Queue()
        for sb in self._all:
            self._free.put(sb)
        self._executor: ThreadPoolExecutor | None = None
        self._exec_lock = threading.Lock()

    @property
    def n_workers(self) -> int:
        return len(self._all)

    def _borrow(self, fn):
        sb = self._free.get()
        try:
            return fn(sb)
        finally:
            self._free.put(sb)

    def run(self, source: str, output: str, context: str = "") -> bool:
        return self._borrow(lambda sb: sb.run(source, output, context))

    def run_raw_program(self, req: dict[str, Any]) -> dict:
        return self._borrow(lambda sb: sb.run_raw_program(req))

    def run_program(self, source: str, tests: Sequence[Any]) -> ProgramResult:
        return _run_program_on(self.run_raw_program, source, tests)

    def _pool_map(self, fn, items):
        with self._exec_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.n_workers, thread_name_prefix="claas-grader")
            executor = self._executor
        return list(executor.map(fn, items))

    def map(self, calls: Iterable[tuple[str, str, str]]) -> list[bool | GraderError]:
        """Grade ``(source, output, context)`` triples in parallel; each result is a bool or the GraderError."""

        def one(c):
            try:
                return self.run(*c)
            except GraderError as e:
                return e

        return self._pool_map(one, list(calls))

    def run_programs(self, jobs: Iterable[tuple[str, Sequence[Any]]]) -> list[ProgramResult]:
        """``run_program`` for many ``(source, tests)`` pairs, up to ``n_workers`` at a time, in input order."""
        jobs = list(jobs)
        for _source, tests in jobs:  # malformed tests are the caller's bug: report before anything runs
            _check_tests(tests)
        return self._pool_map(lambda job: self.run_program(*job), jobs)

    def start(self) -> None:
        """Start every zygote now (in parallel), so the first grading calls do not pay the start-up."""
        threads = [threading.Thread(target=sb.start) for sb in self._all]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @property
    def stats(self) -> SandboxStats:
        total = SandboxStats()
        for sb in self._all:
            total = total + sb.stats
        return total

    @property
    def restarts(self) -> int:
        return self.stats.restarts

    def close(self) -> None:
        with self._exec_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
        for sb in self._all:
            sb.close()

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


# -- programs against test cases ------------------------------------------------------------------

@dataclass(frozen=True)
class IOTest:
    """Run the program as a script on ``stdin``; pass when its stdout equals ``expected_stdout``."""

    stdin: str
    expected_stdout: str


@dataclass(frozen=True)
class CallTest:
    """Call ``fn(*args)`` of the program; pass when the (JSON round-tripped) value equals ``expected``."""

    fn: str
    args: tuple = ()
    expected: Any = None
    atol: float = 0.0


@dataclass(frozen=True)
class ProgramResult:
    """``status``: passed | failed | timeout | sandbox_error; ``details``: one line per test (why it failed)."""

    status: str
    passed: int
    total: int
    details: tuple[str, ...] = field(default=())

    @property
    def all_passed(self) -> bool:
        return self.status == "passed"

    @property
    def reward(self) -> float | None:
        """1.0 all tests passed, 0.0 otherwise, None on a sandbox failure (SPEC A.1.4)."""
        if self.status == "sandbox_error":
            return None
        return 1.0 if self.all_passed else 0.0


def _normalize_stdout(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def _close(a: Any, b: Any, atol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=0.0, abs_tol=atol) if atol > 0 else float(a) == float(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], atol) for k in a)
    return type(a) is type(b) and a == b


def _check_tests(tests: Sequence[Any]) -> list[Any]:
    if isinstance(tests, (str, IOTest, CallTest)):
        tests = [tests]
    tests = list(tests)
    if not tests:
        raise ValueError("run_program: tests is empty; give at least one IOTest, CallTest or assertion string")
    for i, t in enumerate(tests):
        if isinstance(t, IOTest):
            if not (isinstance(t.stdin, str) and isinstance(t.expected_stdout, str)):
                raise ValueError(f"run_program: tests[{i}] IOTest needs str stdin and expected_stdout")
        elif isinstance(t, CallTest):
            if not (isinstance(t.fn, str) and t.fn.isidentifier()):
                raise ValueError(f"run_program: tests[{i}] CallTest.fn must be a function name, got {t.fn!r}")
            if not isinstance(t.args, (tuple, list)):
                raise ValueError(f"run_program: tests[{i}] CallTest.args must be a tuple of arguments")
        elif not isinstance(t, str):
            raise ValueError(f"run_program: tests[{i}] is a {type(t).__name__}; expected IOTest, CallTest or str")
    return tests


def _run_program_on(send, source: str, tests: Sequence[Any]) -> ProgramResult:
    if not isinstance(source, str):
        raise ValueError(f"run_program: source must be a str, got {type(source).__name__}")
    tests = _check_tests(tests)
    details: list[str | None] = [None] * len(tests)
    ok = [False] * len(tests)
    timed_out = sandbox_error = False

    def fail_all(idx, reply):
        nonlocal timed_out, sandbox_error
        err = str(reply.get("error", "error"))
        timed_out |= err.startswith("timeout")
        sandbox_error |= bool(reply.get("sandbox_failure"))
        for i in idx:
            details[i] = err

    def send_safe(req):
        try:
            return send(req)
        except GraderError as e:  # a protocol failure, already counted by the sandbox
            return {"ok": False, "error": str(e), "sandbox_failure": True}

    for i, t in enumerate(tests):
        if isinstance(t, IOTest):
            reply = send_safe({"mode": "io", "source": source, "stdin": t.stdin})
            if not reply["ok"]:
                fail_all([i], reply)
            elif _normalize_stdout(reply.get("stdout", "")) == _normalize_stdout(t.expected_stdout):
                ok[i] = True
            else:
                details[i] = "wrong output"
    for mode, cls in (("call", CallTest), ("assert", str)):
        idx = [i for i, t in enumerate(tests) if isinstance(t, cls)]
        if not idx:
            continue
        wire = ([{"fn": tests[i].fn, "args": _json_roundtrip(list(tests[i].args))} for i in idx] if mode == "call"
                else [{"code": tests[i]} for i in idx])
        reply = send_safe({"mode": mode, "source": source, "tests": wire})
        results = reply.get("results") if reply["ok"] else None
        if not isinstance(results, list) or len(results) != len(idx):
            if reply["ok"]:
                reply = {"ok": False, "error": "the program's process reported a wrong number of results"}
            fail_all(idx, reply)
            continue
        for i, r in zip(idx, results):
            if not r["ok"]:
                details[i] = r.get("error", "error")
            elif mode == "assert":
                ok[i] = True
            else:
                try:
                    got = json.loads(r["value"])
                except (ValueError, RecursionError):  # RecursionError: nested thousands deep
                    details[i] = "unreadable return value"
                    continue
                if _close(got, _json_roundtrip(tests[i].expected), float(tests[i].atol)):
                    ok[i] = True
                else:
                    details[i] = f"returned {r['value'][:200]}"
    n_ok = sum(ok)
    if sandbox_error:
        status = "sandbox_error"
    elif n_ok == len(tests):
        status = "passed"
    else:
        status = "timeout" if timed_out else "failed"
    return ProgramResult(status, n_ok, len(tests), tuple(d or "ok" for d in details))


def run_program(source: str, tests: Sequence[Any], timeout_s: float | None = None, *,
                limits: SandboxLimits | None = None, pool: GraderPool | None = None) -> ProgramResult:
    """Run a model-written program against test cases in the sandbox (see the module docstring).

    ``timeout_s`` overrides ``limits.timeout_s`` (wall clock per jailed process). Without ``pool`` the
    process-wide pool for these limits is used. Raises ``ValueError`` only for malformed ``tests``.
    """
    if pool is None:
        limits = limits or DEFAULT_LIMITS
        if timeout_s is not None:
            limits = SandboxLimits(**{**limits.__dict__, "timeout_s": float(timeout_s),
                                      "cpu_s": max(limits.cpu_s, math.ceil(timeout_s))})
        pool = shared_pool(limits)
    elif timeout_s is not None and timeout_s != pool.limits.timeout_s:
        raise ValueError(f"run_program: timeout_s={timeout_s} differs from the given pool's "
                         f"limits.timeout_s={pool.limits.timeout_s}; set it on the pool")
    return pool.run_program(source, tests)
