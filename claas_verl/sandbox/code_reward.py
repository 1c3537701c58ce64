"""Code-domain reward: the model's program, run against test cases in the OS sandbox.

``code_reward(response, spec) -> float | None``: the last fenced code block of the response (thinking
already stripped by the caller) is the program; ``spec`` is the test specification, a dict or its JSON:

.. code-block:: json

    {"tests": [{"stdin": "1 2\\n", "stdout": "3\\n"},           // IOTest
               {"fn": "add", "args": [1, 2], "expected": 3},    // CallTest (optional "atol")
               "assert add(2, 2) == 4"],                         // assertion snippet
     "timeout_s": 5}

Reward 1.0 when every test passes, 0.0 otherwise (no code block, crash, wrong answer, timeout), None on a
sandbox failure (docs/math.md §A.1.4). Programs run through :func:`claas_verl.sandbox.run_program`, never in
this process.
"""

from __future__ import annotations

import json
import re
from typing import Any

from claas_verl.sandbox import CallTest, IOTest, SandboxLimits, run_program

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> str | None:
    """The last fenced code block (a ``python``/``py`` block when there is one), or None."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (py or [body for _, body in blocks])[-1]


def parse_tests(spec: Any) -> tuple[list[Any], float | None]:
    """A test specification (dict or JSON text, see the module docstring) -> (tests, timeout_s)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"code test spec is not JSON: {e}") from e
    if not isinstance(spec, dict) or not isinstance(spec.get("tests"), list) or not spec["tests"]:
        raise ValueError("code test spec must be an object with a non-empty 'tests' list")
    tests: list[Any] = []
    for i, t in enumerate(spec["tests"]):
        if isinstance(t, str):
            tests.append(t)
        elif isinstance(t, dict) and {"stdin", "stdout"} <= t.keys():
            tests.append(IOTest(str(t["stdin"]), str(t["stdout"])))
        elif isinstance(t, dict) and "fn" in t and "expected" in t:
            tests.append(CallTest(str(t["fn"]), tuple(t.get("args", ())), t["expected"], float(t.get("atol", 0.0))))
        else:
            raise ValueError(f"code test spec: tests[{i}] must be an assertion string, {{stdin, stdout}} or "
                             f"{{fn, args, expected[, atol]}}; got {t!r:.200}")
    timeout = spec.get("timeout_s")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"code test spec: timeout_s must be a positive number, got {timeout!r}")
    return tests, (float(timeout) if timeout is not None else None)


def code_reward(response: str, spec: Any, limits: SandboxLimits | None = None) -> float | None:
    """1.0 / 0.0 / None (sandbox failure) for ``response`` against the tests of ``spec``."""
    tests, timeout = parse_tests(spec)
    program = extract_program(response)
    if program is None:
        return 0.0
    return run_program(program, tests, timeout, limits=limits).reward
