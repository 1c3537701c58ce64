"""Many sandboxes: the pool, the process-wide shared pools, the picklable grader verifier and ``run_program``."""

from __future__ import annotations

import atexit
import math
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from queue import Queue
from typing import Any

from claas_verl.sandbox.errors import GraderError
from claas_verl.sandbox.grader_sandbox import GraderSandbox, SandboxStats
from claas_verl.sandbox.isolation import DEFAULT_LIMITS, IsolationSupport, SandboxLimits
from claas_verl.sandbox.programs import ProgramResult, _check_tests, _run_program_on


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
