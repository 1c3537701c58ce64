"""Programs against test cases: the test types, their checks, and the comparison of replies with expectations
(the parent's side; the expected values never enter the jail)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from claas_verl.sandbox.errors import GraderError


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
        """1.0 all tests passed, 0.0 otherwise, None on a sandbox failure (docs/math.md §A.1.4)."""
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
