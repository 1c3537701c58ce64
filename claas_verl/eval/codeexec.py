"""Model-written code runs only here, inside the hardened grader sandbox (claas_verl.envs.sandbox).

:func:`run_program` is the single entry point every code scorer (MBPP, MBPP+, LCB-e) calls. It runs the
candidate ``source`` and then the ``tests`` (Python statements, executed in the candidate's namespace) in a
forked, rlimited, network- and write-blocked child of the sandbox zygote; it returns True only when both run
to completion within ``timeout_s``. At merge time this function is the one place to point at the sandbox's
``run_program`` API; today it drives the grader entry point (``GraderPool.run``) with a fixed harness.
"""

from __future__ import annotations

import json
import math

from claas_verl.envs.base import GraderError
from claas_verl.envs.sandbox import SandboxLimits, shared_pool

# The harness is the grader: it decodes the job, executes the candidate, then the tests, in one namespace.
# stdin/stdout are in-memory buffers so stdin/stdout problems (LCB) work with the zygote's /dev/null streams.
_HARNESS = '''
def grade_output_correct(output):
    import json
    job = json.loads(output)
    ns = {"__name__": "__claas_candidate__", "__builtins__": __builtins__}
    exec(compile(job["source"], "<candidate>", "exec"), ns)
    exec(compile(job["tests"], "<tests>", "exec"), ns)
    return True
'''


def run_program(source: str, tests: str, timeout_s: float = 10.0, memory_mb: int = 1024, n_workers: int = 1) -> bool:
    """True iff ``source`` followed by ``tests`` runs without an exception inside the sandbox within ``timeout_s``."""
    if not isinstance(source, str) or not isinstance(tests, str):
        raise TypeError("run_program: source and tests must be str")
    limits = SandboxLimits(timeout_s=float(timeout_s), cpu_s=max(1, math.ceil(timeout_s)), memory_mb=int(memory_mb))
    try:
        return shared_pool(limits, n_workers).run(_HARNESS, json.dumps({"source": source, "tests": tests}))
    except GraderError:
        return False


def run_stdio(program: str, cases: list[tuple[str, str]], timeout_s: float = 10.0) -> bool:
    """True iff ``program`` (run as ``__main__`` once per case) prints each expected stdout for its stdin.

    Output lines are compared after stripping trailing white space per line and blank lines at the end
    (the usual LiveCodeBench comparison).
    """
    tests = (
        "import io as _io, sys as _sys\n"
        f"_SRC = {program!r}\n"
        f"_CASES = {[(str(i), str(o)) for i, o in cases]!r}\n"
        "def _norm(s):\n"
        "    return '\\n'.join(l.rstrip() for l in s.strip().splitlines())\n"
        "for _inp, _exp in _CASES:\n"
        "    _out = _io.StringIO()\n"
        "    _sys.stdin, _sys.stdout = _io.StringIO(_inp), _out\n"
        "    try:\n"
        "        exec(compile(_SRC, '<candidate>', 'exec'), {'__name__': '__main__'})\n"
        "    finally:\n"
        "        _sys.stdin, _sys.stdout = _sys.__stdin__, _sys.__stdout__\n"
        "    assert _norm(_out.getvalue()) == _norm(_exp), 'wrong output'\n"
    )
    return run_program("", tests, timeout_s)
