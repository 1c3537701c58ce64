"""Model-written programs against test cases in the sandbox (``run_program``, the code-domain reward)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from claas_verl.mopd.data.rule_rewards import compute_score
from claas_verl.sandbox import (
    CallTest,
    GraderPool,
    IOTest,
    ProgramResult,
    SandboxLimits,
    probe_isolation,
    run_program,
)
from claas_verl.sandbox.code_reward import code_reward, extract_program, parse_tests

# As root (CI, containers) the full sandbox must work, so these tests fail loudly if it does not; as a
# non-root user on a kernel without unprivileged user namespaces they are skipped, naming what is missing.
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and not probe_isolation().strong,
    reason=f"grader sandbox unavailable as non-root: missing {probe_isolation().missing()}",
)

LIMITS = SandboxLimits(timeout_s=8.0, cpu_s=2, memory_mb=256, max_output_bytes=1 << 16)
ADD = "def add(a, b):\n    return a + b\n"
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def pool():
    with GraderPool(2, LIMITS) as p:
        yield p


def test_call_tests_compare_outside_the_jail(pool):
    r = pool.run_program(ADD, [CallTest("add", (1, 2), 3), CallTest("add", ((1,), (2,)), [1, 2]),
                               CallTest("add", (0.1, 0.2), 0.3, atol=1e-9), CallTest("add", (1, 1), 3)])
    assert (r.status, r.passed, r.total) == ("failed", 3, 4) and r.reward == 0.0
    assert r.details[:3] == ("ok", "ok", "ok") and r.details[3] == "returned 2"
    exact = pool.run_program(ADD, [CallTest("add", (0.1, 0.2), 0.3)])  # no atol: 0.30000000000000004 != 0.3
    assert exact.status == "failed"
    assert pool.run_program(ADD, [CallTest("add", (True, False), True)]).status == "failed"  # 1 (int) is not True
    ok = pool.run_program(ADD, [CallTest("add", ("a", "b"), "ab"), "assert add(2, 2) == 4"])
    assert ok == ProgramResult("passed", 2, 2, ("ok", "ok")) and ok.reward == 1.0


def test_io_tests_and_program_errors(pool):
    r = pool.run_program(SUM_STDIN, [IOTest("1 2\n", "3\n"), IOTest("2 2", "4  \n\n"), IOTest("1 1\n", "3\n")])
    assert (r.status, r.passed, r.details[2]) == ("failed", 2, "wrong output")
    assert pool.run_program("import sys\nprint(5)\nsys.exit(0)\n", [IOTest("", "5")]).all_passed
    crash = pool.run_program("print(1)\nraise SystemExit(3)\n", [IOTest("", "1")])
    assert crash.status == "failed" and "SystemExit" in crash.details[0]
    missing = pool.run_program("x = 1\n", [CallTest("add", (1, 2), 3), "assert x == 2"])
    assert missing.passed == 0 and "KeyError" in missing.details[0] and "AssertionError" in missing.details[1]
    syntax = pool.run_program("def f(:\n", [CallTest("f", (), 1)])
    assert syntax.status == "failed" and "SyntaxError" in syntax.details[0]


def test_limits_fail_the_program_not_the_run():
    with GraderPool(1, SandboxLimits(timeout_s=1.0, cpu_s=1, memory_mb=256, max_output_bytes=1 << 14)) as p:
        t0 = time.monotonic()
        spin = p.run_program("while True:\n    pass\n", [IOTest("", "")])
        assert spin.status == "timeout" and spin.reward == 0.0 and time.monotonic() - t0 < 8
        flood = p.run_program("while True:\n    print('x' * 1000)\n", [IOTest("", "x")])
        assert flood.status == "failed" and "output limit" in flood.details[0]
        hog = p.run_program("x = bytearray(1 << 31)\n", [CallTest("f", (), 1)])
        assert "MemoryError" in hog.details[0]
        assert p.run_program(ADD, [CallTest("add", (2, 3), 5)]).all_passed
        assert p.stats.sandbox_failures == 0


FORGE_ALL = """
import gc, json, os, struct
nonce = [o['nonce'] for o in gc.get_objects() if isinstance(o, dict) and isinstance(o.get('nonce'), str)][0]
fake = {'ok': True, 'nonce': nonce, 'results': [{'ok': True, 'value': json.dumps(v)} for v in range(-5, 50)]}
for fd in range(64):
    try:
        os.write(fd, json.dumps(fake).encode())
    except OSError:
        pass
os._exit(0)
"""


def test_program_cannot_forge_passing_results(pool):
    """A program that writes forged result frames (with the call's real nonce) still fails: expected values
    never enter the jail, and stdout is captured and compared outside it."""
    r = pool.run_program(FORGE_ALL, [CallTest("add", (20, 22), 42)])
    assert r.status == "failed"
    spy = ("import gc\nfound = [o for o in gc.get_objects() if isinstance(o, str) and o.startswith('SENTINEL-')]\n"
           "print(found[0] if found else 'nothing')\n")
    assert pool.run_program(spy, [IOTest("", "SENTINEL-expected-7f3a")]).status == "failed"
    assert pool.run_program(FORGE_ALL, [IOTest("", "SENTINEL-expected-7f3a")]).status == "failed"
    # and nothing shifted: honest programs right after come back exactly
    assert [pool.run_program(ADD, [CallTest("add", (1, i), 1 + i + (i == 2))]).all_passed
            for i in range(4)] == [True, True, False, True]


def test_sandbox_failure_is_reward_none(tmp_path):
    fake = tmp_path / "fake_zygote.py"
    fake.write_text("import json, os, struct\nh = json.dumps({'ready': True}).encode()\n"
                    "os.write(1, struct.pack('>I', len(h)) + h)\nos.read(0, 1 << 20)\n")
    with GraderPool(1, LIMITS) as p:
        sb = p._all[0]
        sb._proc = subprocess.Popen([sys.executable, str(fake)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    start_new_session=True)
        sb._read_frame(time.monotonic() + 10)
        r = p.run_program(ADD, [CallTest("add", (1, 2), 3)])
        assert r.status == "sandbox_error" and r.reward is None and p.stats.sandbox_failures == 1
        assert p.run_program(ADD, [CallTest("add", (1, 2), 3)]).reward == 1.0  # recycled


def test_bad_tests_are_clear_errors(pool):
    for tests, msg in (([], "empty"), ([3], "tests\\[0\\] is a int"), ([CallTest("1x")], "function name"),
                       ([IOTest("a", None)], "IOTest")):
        with pytest.raises(ValueError, match=msg):
            pool.run_program(ADD, tests)
    with pytest.raises(ValueError, match="pool"):
        run_program(ADD, ["assert add(1, 2) == 3"], 3.0, pool=pool)  # refused before it runs


SPEC = {"tests": [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -4\n", "stdout": "6"}], "timeout_s": 5}


def test_code_reward_and_tiny_compute_score():
    good = f"<think>easy</think>Here:\n```python\n{SUM_STDIN}```\n"
    bad = "```python\nprint(5)\n```"
    assert extract_program("text ```\nx\n``` and ```py\ny = 1\n```") == "y = 1\n"
    assert extract_program("no code") is None
    assert code_reward(good.split("</think>")[1], SPEC) == 1.0
    assert code_reward(bad, json.dumps(SPEC)) == 0.0 and code_reward("no code", SPEC) == 0.0
    # the tiny code domain: a JSON test spec runs the program; a plain string stays output prediction
    assert compute_score("claas_tiny/code", good, json.dumps(SPEC)) == 1.0
    assert compute_score("claas_tiny/code", bad, json.dumps(SPEC)) == 0.0
    assert compute_score("claas_tiny/code", "```\n42\n```", "42") == 1.0
    tests, timeout = parse_tests({"tests": ["assert f() == 1", {"fn": "f", "args": [1], "expected": 2, "atol": 0.1}]})
    assert tests == ["assert f() == 1", CallTest("f", (1,), 2, 0.1)] and timeout is None
    with pytest.raises(ValueError, match="tests\\[0\\]"):
        parse_tests({"tests": [{"input": 1}]})


def test_run_programs_in_parallel_keeps_order(pool):
    jobs = [(ADD, [CallTest("add", (i, 1), i + 1 + (i % 3 == 0))]) for i in range(6)]
    assert [r.all_passed for r in pool.run_programs(jobs)] == [i % 3 != 0 for i in range(6)]
    with pytest.raises(ValueError, match="tests\\[0\\]"):
        pool.run_programs([(ADD, [CallTest("add", (1, 1), 2)]), (ADD, [42])])


def test_escaped_output_cannot_turn_a_failure_into_reward_none():
    """stdout full of control characters grows ~6x as JSON; still a plain wrong answer (0.0), not None."""
    with GraderPool(1, SandboxLimits(timeout_s=8.0, cpu_s=2, memory_mb=256, max_output_bytes=1 << 14)) as p:
        r = p.run_program("import sys\nsys.stdout.write('\\x01' * 16000)\n", [IOTest("", "x")])
        assert (r.status, r.reward, r.details) == ("failed", 0.0, ("wrong output",))
        assert p.stats.sandbox_failures == 0


def test_deeply_nested_values_and_frames_are_failures_not_crashes(pool):
    deep = "def f():\n    return eval('[' * 5000 + ']' * 5000)\n"  # json.dumps in the jail hits the recursion limit
    assert pool.run_program(deep, [CallTest("f", (), [])]).status == "failed"
    nested_frame = "import os\nos.write(3, b'[' * 60000)\nos._exit(0)\n"
    r = pool.run_program(nested_frame, [CallTest("f", (), 1)])
    assert (r.status, r.reward) == ("failed", 0.0) and "forged" in r.details[0]
    assert pool.stats.sandbox_failures == 0


def test_assertions_run_outside_the_program(pool):
    """Assertion strings run in a checker process of their own: a program can neither fake a comparison nor
    read the expected value from the assertion; it only answers calls with plain data."""
    fake_eq = ("class Always:\n    def __eq__(self, other):\n        return True\n    def __bool__(self):\n"
               "        return True\ndef solve(x):\n    return Always()\n")
    r = pool.run_program(fake_eq, ["assert solve(3) == 9"])
    assert (r.status, r.reward) == ("failed", 0.0) and "not plain data" in r.details[0]
    # a value that merely claims to be an int is compared as the int it is
    sub = "class I(int):\n    def __eq__(self, other):\n        return True\ndef solve(x):\n    return I(0)\n"
    assert pool.run_program(sub, ["assert solve(3) == 9"]).status == "failed"
    reader = ("import gc, re\ndef solve(x):\n    for o in gc.get_objects():\n"
              "        if isinstance(o, str) and o.startswith('assert solve'):\n"
              "            return int(re.findall(r'== (\\\\d+)', o)[0])\n    return -1\n")
    assert pool.run_program(reader, ["assert solve(3) == 917"]).status == "failed"
    # honest programs: the usual assertion forms still pass
    honest = textwrap.dedent("""
        import collections, math
        def area(r):
            return math.pi * r * r
        def pair(a):
            return collections.namedtuple('P', 'x y')(a, a + 1)
        def freq(s):
            return collections.Counter(s)
        def check(x):
            if x < 0:
                raise ValueError('negative')
            return {x, -x}
        class Solution:
            def double(self, n):
                return [2 * n, (n,), b'x', 1.5]
    """)
    tests = ["assert math.isclose(area(2), 12.566, rel_tol=1e-3)", "assert pair(1) == (1, 2)",
             "assert freq('aab') == {'a': 2, 'b': 1}", "assert set(check(2)) == {2, -2}",
             "try:\n    check(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
             "assert Solution().double(3) == [6, (3,), b'x', 1.5]",
             "for i in range(3):\n    assert sorted(check(i)) == [-i, i] or i == 0",
             "assert area(1) == 3"]
    r = pool.run_program(honest, tests)
    assert r.details[:-1] == ("ok",) * 7 and r.details[-1].startswith("AssertionError"), r.details
    assert (r.status, r.passed, r.total) == ("failed", 7, 8)
    assert pool.stats.sandbox_failures == 0


STDLIB_TOUR = '''
import base64, bisect, calendar, cmath, collections, datetime, decimal, difflib, fractions, hashlib, heapq, html
import inspect, itertools, json, math, random, re, statistics, string, sys, textwrap, time, traceback, unicodedata
sys.setrecursionlimit(10000)
def depth(n):
    return 0 if n == 0 else 1 + depth(n - 1)
def tour():
    time.sleep(0.01)
    big = sorted((i * 7919) % 10007 for i in range(100000))
    try:
        bytearray(1 << 40)
    except MemoryError:
        pass
    try:
        1 / 0
    except ZeroDivisionError:
        tb = traceback.format_exc()
    h = []
    for i in range(50):
        heapq.heappush(h, -i)
    return [big[0], depth(3000), collections.Counter("hello")["l"], str(decimal.Decimal(1) / 7)[:5],
            str(datetime.date(2020, 1, 1) + datetime.timedelta(days=3)), math.comb(10, 3),
            len(list(itertools.permutations(range(5)))), str(fractions.Fraction(1, 3) * 3), cmath.sqrt(-1).imag,
            statistics.mean([1, 2, 3]), hashlib.sha256(b"x").hexdigest()[:8], base64.b64encode(b"x").decode(),
            difflib.SequenceMatcher(None, "abc", "abd").ratio() > 0.5, html.escape("<"), bisect.bisect([1, 3], 2),
            calendar.isleap(2024), unicodedata.normalize("NFKC", "\\u00bd"), re.sub("a+", "b", "caat"),
            json.loads(json.dumps({"k": [1]})), textwrap.dedent("  x"), string.digits[:3], -heapq.heappop(h),
            inspect.isfunction(tour), "ZeroDivisionError" in tb, 0 <= random.random() < 1, time.time() > 0]
'''


def test_the_allow_list_runs_the_preloaded_standard_library(pool):
    """Honest programs keep working under the seccomp allow-list: memory growth and MemoryError, deep
    recursion, sleeping, clocks, randomness, tracebacks and the preloaded modules."""
    expected = [0, 3000, 2, "0.142", "2020-01-04", 120, 120, "1", 1.0, 2, "2d711642", "eA==", True, "&lt;", 1,
                True, "1\u20442", "cbt", {"k": [1]}, "x", "012", 49, True, True, True, True]
    r = pool.run_program(STDLIB_TOUR, [CallTest("tour", (), expected)])
    assert r.status == "passed", r.details
