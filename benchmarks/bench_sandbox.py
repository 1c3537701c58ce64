"""Grader sandbox throughput: graders/s per pool size, per-call overhead, program runs/s.

    PYTHONPATH=. python benchmarks/bench_sandbox.py [--n 300] [--pools 1,2,4]

Prints, for a trivial grader: the in-process call (the floor), one sandbox's serial latency per call (fork
+ jail + seccomp + two pipe round trips), a fresh interpreter per call (what a zygote saves), zygote start,
and graders/s through ``GraderPool.map`` for each pool size with the speed-up over one sandbox. Then
``run_program`` with 5 call tests (one jailed process), 5 assertion tests (the program's process and a
checker process) and 5 IO tests (five). Figures depend on the machine's cores: the pool scales up to about
one sandbox per core.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from claas_verl.sandbox import (
    CallTest,
    GraderPool,
    GraderSandbox,
    IOTest,
    SandboxLimits,
    probe_isolation,
)
from claas_verl.sandbox.isolation import _clean_env

TRIVIAL = "def grade_output_correct(output):\n    return 'secret' not in output.lower()\n"
LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=5, memory_mb=512)


def _timed(fn, n):
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="grading calls per measurement")
    ap.add_argument("--pools", default="1,2,4", help="pool sizes to measure")
    args = ap.parse_args()
    iso = probe_isolation()
    print(f"isolation: namespaces={iso.namespaces} seccomp={iso.seccomp_path is not None} root={iso.root} "
          f"cores={os.cpu_count()}")

    ns: dict = {}
    exec(TRIVIAL, ns)
    floor = _timed(lambda i: ns["grade_output_correct"](f"reply {i}"), 10000)

    t0 = time.perf_counter()
    sb = GraderSandbox(LIMITS)
    sb.start()
    t_start = time.perf_counter() - t0
    sb.run(TRIVIAL, "warm")
    serial = _timed(lambda i: sb.run(TRIVIAL, f"reply {i}"), args.n)
    sb.close()
    fresh = _timed(lambda i: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], env=_clean_env(),
                                            check=True), 10)
    print(f"trivial grader in-process      {floor * 1e6:8.2f} us/call (floor)")
    print(f"one sandbox, serial            {serial * 1e3:8.2f} ms/call  = {1 / serial:7.1f} graders/s "
          f"(overhead {(serial - floor) * 1e3:.2f} ms/call)")
    print(f"fresh interpreter per call     {fresh * 1e3:8.2f} ms/call  (a zygote saves {fresh / serial:.1f}x)")
    print(f"zygote start (unshare + python){t_start * 1e3:8.1f} ms, once per sandbox")

    base = None
    for size in (int(x) for x in args.pools.split(",")):
        with GraderPool(size, LIMITS) as pool:
            pool.start()
            pool.map([(TRIVIAL, "warm", "")] * size)
            calls = [(TRIVIAL, f"reply {i}", "") for i in range(args.n)]
            t0 = time.perf_counter()
            out = pool.map(calls)
            rate = args.n / (time.perf_counter() - t0)
            assert out == [True] * args.n and pool.stats.sandbox_failures == 0
        base = base or rate
        print(f"pool of {size:2d} sandboxes           {rate:8.1f} graders/s  ({rate / base:.2f}x one sandbox)")

    prog = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
    calls5 = [CallTest("add", (i, i), 2 * i) for i in range(5)]
    io5 = [IOTest(f"{i} {i}\n", f"{2 * i}\n") for i in range(5)]
    asserts5 = [f"assert add({i}, {i}) == {2 * i}" for i in range(5)]
    with GraderPool(1, LIMITS) as pool:
        pool.run_program(prog, calls5)
        m = max(args.n // 5, 10)
        t_call = _timed(lambda i: pool.run_program(prog, calls5), m)
        t_assert = _timed(lambda i: pool.run_program(prog, asserts5), m)
        t_io = _timed(lambda i: pool.run_program(prog, io5), m // 2)
    print(f"run_program, 5 call tests      {t_call * 1e3:8.2f} ms/program ({1 / t_call:6.1f} programs/s, one sandbox)")
    print(f"run_program, 5 assertions     {t_assert * 1e3:8.2f} ms/program ({1 / t_assert:6.1f} programs/s, "
          "one sandbox)")
    print(f"run_program, 5 IO tests        {t_io * 1e3:8.2f} ms/program ({1 / t_io:6.1f} programs/s, one sandbox)")


if __name__ == "__main__":
    main()
