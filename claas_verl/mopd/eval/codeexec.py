"""Model-written code runs only here, inside the hardened grader sandbox (:mod:`claas_verl.sandbox`).

:func:`run_program` and :func:`run_stdio` are the only entry points the code scorers (MBPP, MBPP+, LCB-e) call.
Both go through the sandbox's ``run_program`` API: each program runs in a jailed, namespaced, seccomp-filtered
child (no network, no processes, no host files), and the comparison of stdout happens outside the jail, so a
program cannot forge its own pass. A sandbox failure (docs/math.md §A.1.4: reward None) counts as a failed item here,
since a benchmark score has no "dropped" state.
"""

from __future__ import annotations

from claas_verl.sandbox import IOTest
from claas_verl.sandbox import run_program as _sandboxed


def run_program(source: str, tests: str, timeout_s: float = 10.0) -> bool:
    """True iff ``tests`` (Python statements, typically asserts, calling the functions ``source`` defines) run
    without an exception within ``timeout_s``. The statements run in a jailed checker process, the program in
    another; the program's return values cross as plain data (see the sandbox's assertion tests)."""
    if not isinstance(source, str) or not isinstance(tests, str):
        raise TypeError("run_program: source and tests must be str")
    return _sandboxed(source, [tests], timeout_s).all_passed


def run_stdio(program: str, cases: list[tuple[str, str]], timeout_s: float = 10.0) -> bool:
    """True iff ``program`` (run as a script once per case) prints each expected stdout for its stdin.

    Output lines are compared after stripping trailing white space per line and at the end (the usual
    LiveCodeBench comparison), outside the sandbox.
    """
    if not cases:
        raise ValueError("run_stdio: cases is empty")
    return _sandboxed(program, [IOTest(str(i), str(o)) for i, o in cases], timeout_s).all_passed
