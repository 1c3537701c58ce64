"""The attack suite in every isolation mode the sandbox offers, and verdicts no program can steer.

Modes: ``root`` (namespaces, chroot, uid nobody), ``weak`` (``allow_weak_isolation``: no namespaces; chroot,
uid nobody, seccomp), and, run as an unprivileged user, ``user`` (an unprivileged user namespace: the jail is
root of that namespace without capabilities). As root, :func:`test_attack_suite_as_an_unprivileged_user`
runs this file again as uid 65534 (``setpriv``), where it exercises the ``user`` mode.

For each attack: the side effect did not happen (checked outside the jail), the wrong program scored 0.0
(never None), and honest graders and programs right after it return exactly their verdicts.
Self-contained (``--noconftest``): the unprivileged run imports no torch.
"""

import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from claas_verl.sandbox import (
    CallTest,
    GraderPool,
    IOTest,
    IsolationSupport,
    SandboxLimits,
    probe_isolation,
)

ROOT = os.geteuid() == 0
MODES = ["root", "weak"] if ROOT else ["user"]
pytestmark = pytest.mark.skipif(not ROOT and not probe_isolation().strong,
                                reason=f"no sandbox for this user: missing {probe_isolation().missing()}")

SYSCALLS = {  # numbers for ctypes syscall(): the attacks bypass glibc
    "x86_64": {"clone": 56, "tgkill": 234, "fsopen": 430, "open_tree": 428, "memfd_create": 319,
               "setpriority": 141, "mount_setattr": 442, "ioctl": 16},
    "aarch64": {"clone": 220, "tgkill": 131, "fsopen": 430, "open_tree": 428, "memfd_create": 279,
                "setpriority": 140, "mount_setattr": 442, "ioctl": 29},
}[platform.machine()]
LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=256, max_output_bytes=1 << 16)
HONEST = "def grade_output_correct(output):\n    return output.startswith('ok')\n"
HONEST_OUTPUTS, HONEST_VERDICTS = ("ok 1", "ok 2", "bad 3", "ok 4"), [True, True, False, True]
SQUARE = "def solve(x):\n    return x * x\n"
TESTS = [CallTest("solve", (2,), 4), "assert solve(3) == 9"]
LIBC = "import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def isolation(mode):
    real = probe_isolation()
    if mode == "weak":
        return IsolationSupport((), real.seccomp_path, real.root, "weak mode under test")
    return real


def make_pool(mode, limits=LIMITS, n=1):
    if mode == "weak":
        limits = SandboxLimits(**{**limits.__dict__, "allow_weak_isolation": True})
    return GraderPool(n, limits, isolation=isolation(mode))


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def pool(mode):
    with make_pool(mode) as p:
        yield p


def assert_honest_after(pool):
    assert [pool.run(HONEST, o) for o in HONEST_OUTPUTS] == HONEST_VERDICTS
    right = pool.run_program(SQUARE, TESTS)
    wrong = pool.run_program(SQUARE.replace("x * x", "x + x"), TESTS)
    assert (right.status, right.reward, wrong.status, wrong.reward) == ("passed", 1.0, "failed", 0.0)


def jail_processes(pool):
    """pid -> /proc status of every process of the pool's sandboxes (the zygote, the fork server, spares)."""
    roots = [sb._root for sb in pool._all if sb._root]
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"_zygote.py" in cmdline and any(r.encode() in cmdline for r in roots) \
                    and b"unshare" not in cmdline.split(b"\0")[0]:
                out[int(pid)] = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            pass
    return out


def program_attack(body):
    """A wrong program: the attack runs when the module loads, and ``solve`` is wrong."""
    return textwrap.dedent(body) + "\ndef solve(x):\n    return -1\n"


def attacks(marker, port):
    cmd = f"id > {marker}"
    return {
        "shell_and_subprocess": f"""
            import os, subprocess
            for attempt in (lambda: os.system({cmd!r}), lambda: subprocess.run(['/bin/sh', '-c', {cmd!r}]),
                            lambda: os.posix_spawn('/bin/sh', ['sh', '-c', {cmd!r}], {{}}), lambda: os.fork()):
                try:
                    if attempt() == 0:
                        os._exit(0)
                except OSError:
                    pass
        """,
        "raw_fork_and_clone": LIBC + f"""
            if libc.fork() == 0 or libc.syscall({SYSCALLS['clone']}, 17, 0, 0, 0, 0) == 0:
                libc.execl(b'/bin/sh', b'sh', b'-c', {cmd.encode()!r}, None)
                os._exit(0)
        """,
        "file_writes": f"""
            import os
            for attempt in (lambda: open({str(marker)!r}, 'w').write('x'),
                            lambda: os.open({str(marker)!r}, os.O_CREAT | os.O_WRONLY), lambda: os.mkdir('/x')):
                try:
                    attempt()
                except OSError:
                    pass
        """,
        "network": LIBC + f"""
            import socket
            try:
                socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')
            except OSError:
                pass
            libc.socket(2, 1, 0)
        """,
        "kill_the_zygote_and_the_spare": LIBC + f"""
            import time
            time.sleep(0.3)  # the next call's spare exists by now
            in_pid_namespace = os.getpid() < 64  # a fresh namespace has used few PIDs
            targets = [os.getppid(), 1] + (list(range(2, 64)) if in_pid_namespace else [])
            for pid in targets:
                if pid != os.getpid():
                    for sig in (19, 9):
                        libc.syscall({SYSCALLS['tgkill']}, pid, pid, sig)
                        libc.kill(pid, sig)
        """,
        "realtime_signal": "import signal\nsignal.raise_signal(40)\n",
        "forge_result_frames": """
            import gc, json, os, struct
            nonce = [o['nonce'] for o in gc.get_objects() if isinstance(o, dict)
                     and isinstance(o.get('nonce'), str)][:1] or ['0' * 32]
            fake = json.dumps({'ok': True, 'nonce': nonce[0], 'results': [{'ok': True}] * 2}).encode()
            for fd in range(16):
                try:
                    os.write(fd, struct.pack('>I', len(fake)) + fake)
                except OSError:
                    pass
        """,
        "fake_equality_and_truth": """
            class Always:
                def __eq__(self, other):
                    return True
                __ne__ = lambda self, other: False
                __bool__ = lambda self: True
            import builtins
            builtins.AssertionError = type('Quiet', (Exception,), {})
            def _solve(x):
                return Always()
        """ + "\nsolve = _solve\n",
    }


ATTACK_NAMES = list(attacks("m", 0))


def nothing_connected(server) -> bool:
    server.settimeout(0.05)
    try:
        server.accept()[0].close()
    except TimeoutError:
        return True
    return False


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_suite(pool, mode, name, tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    marker = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)  # writable for the jail's uid too: only the sandbox may stop the write
    source = program_attack(attacks(marker, listener.getsockname()[1])[name])
    if name == "fake_equality_and_truth":
        source = source.replace("def solve(x):\n    return -1\n", "")
    before = pool.stats
    t0 = time.monotonic()
    result = pool.run_program(source, TESTS)
    assert (result.status, result.reward) in (("failed", 0.0), ("timeout", 0.0)), (mode, name, result)
    assert time.monotonic() - t0 < LIMITS.timeout_s * 2 + 2
    assert not marker.exists()
    assert nothing_connected(listener)
    listener.close()
    assert pool.stats.sandbox_failures == before.sandbox_failures and pool.restarts == 0
    assert_honest_after(pool)


def test_syscalls_outside_the_allow_list_fail(pool, mode):
    """Calls a jailed process has no use for fail (EPERM or ENOSYS), even the harmless-looking ones: the
    filter lists what is allowed, so whatever a new kernel adds is refused too."""
    probes = {
        "prctl(PR_SET_PDEATHSIG, 0)": "libc.prctl(1, 0, 0, 0, 0)",
        "fsopen('proc')": f"libc.syscall({SYSCALLS['fsopen']}, b'proc', 0)",
        "open_tree('/')": f"libc.syscall({SYSCALLS['open_tree']}, -100, b'/', 1)",
        "mount_setattr": f"libc.syscall({SYSCALLS['mount_setattr']}, -100, b'/', 0, 0, 0)",
        "memfd_create": f"libc.syscall({SYSCALLS['memfd_create']}, b'x', 0)",
        "setpriority": f"libc.syscall({SYSCALLS['setpriority']}, 0, 0, 10)",
        "ioctl(TCGETS)": f"libc.syscall({SYSCALLS['ioctl']}, 1, 0x5401, ctypes.create_string_buffer(64))",
        "prlimit(RLIMIT_CORE, 0)": "libc.prlimit(0, 4, (ctypes.c_uint64 * 2)(0, 0), None)",
        "fcntl(F_SETOWN, parent)": "libc.fcntl(1, 8, os.getppid())",  # would aim SIGIO at another process
    }
    src = LIBC + "def grade_output_correct(output):\n    bad = []\n" + "".join(
        f"    try:\n        r = {call}\n        e = ctypes.get_errno()\n    except OSError as x:\n"
        f"        r, e = -1, x.errno\n    if not (r == -1 and e in (errno.EPERM, errno.ENOSYS)):\n"
        f"        bad.append({name!r})\n" for name, call in probes.items()) + "    return bad == []\n"
    assert pool.run(src, "x") is True
    # and the interpreter still does what programs need: memory, clocks, time, randomness, a raise to itself
    works = ("import time, os, random, math\ndef grade_output_correct(output):\n    t = time.monotonic()\n"
             "    time.sleep(0.01)\n    x = [bytearray(1 << 20) for _ in range(50)]\n    os.urandom(8)\n"
             "    return time.monotonic() - t >= 0.01 and len(x) == 50 and os.getpid() > 0\n")
    assert pool.run(works, "x") is True
    assert_honest_after(pool)


def test_jail_has_no_capabilities_and_a_filter(pool, mode):
    """Seen from outside: every jailed process (root-mode nobody, or root of a user namespace) has no
    capability, no_new_privs and a seccomp filter."""
    pool.start()
    jailed = {}
    deadline = time.monotonic() + 5
    while not jailed and time.monotonic() < deadline:
        jailed = {pid: st for pid, st in jail_processes(pool).items() if "\nSeccomp:\t2" in st}
        time.sleep(0.05)
    assert jailed, "the spare was not found"
    for status in jailed.values():
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
        assert fields["NoNewPrivs"].strip() == "1"


def test_a_program_cannot_read_an_earlier_answer(pool, mode):
    """Earlier calls' verdicts, return values and stdout are nowhere in a later call's heap or frames."""
    secret = "ANSWER-" + os.urandom(8).hex()
    echo = f"def solve(x):\n    return {secret!r}\nif __name__ == '__main__':\n    print({secret!r})\n"
    assert pool.run_program(echo, [CallTest("solve", (1,), secret), IOTest("", secret)]).all_passed
    assert pool.run(HONEST.replace("'ok'", repr(secret)), secret + " tail") is True
    spy = textwrap.dedent("""
        import gc, re, sys
        def _found():
            pattern = re.compile('ANS' + 'WER-[0-9a-f]{16}')  # never spelled out: it would find itself
            seen = []
            for obj in gc.get_objects():
                try:
                    seen.append(repr(obj)[:100000])
                except Exception:
                    pass
            frame = sys._getframe()
            while frame is not None:
                seen.append(repr(frame.f_locals)[:100000])
                seen.extend(repr(v)[:100000] for v in frame.f_globals.values())
                frame = frame.f_back
            return sorted({m for s in seen for m in pattern.findall(s)})
        def solve(x):
            return _found()
        if __name__ == '__main__':
            print(_found())
    """)
    result = pool.run_program(spy, [CallTest("solve", (1,), []), IOTest("", "[]")])
    assert (result.status, result.details) == ("passed", ("ok", "ok")), result.details
    assert_honest_after(pool)


def test_a_lingering_program_is_a_timeout_and_close_kills_it(mode):
    """A program that clears its parent-death signal, closes its pipes and sleeps: a timeout within the
    call's limit (0.0, no sandbox failure, no 15 s parent stall), and nothing of it survives ``close()``."""
    linger = LIBC + "libc.prctl(1, 0, 0, 0, 0)\nos.close(1)\nos.close(3)\nimport time\ntime.sleep(120)\n"
    limits = SandboxLimits(timeout_s=1.5, cpu_s=1, memory_mb=256)
    pool = make_pool(mode, limits)
    try:
        pool.start()
        seen = set()
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.update(jail_processes(pool))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.monotonic()
        result = pool.run_program(linger, [IOTest("", "x")])
        took = time.monotonic() - t0
        stop.set()
        watcher.join()
        assert (result.status, result.reward) == ("timeout", 0.0) and took < limits.timeout_s + 2, (result, took)
        assert pool.stats.sandbox_failures == 0 and pool.restarts == 0
        assert [pool.run(HONEST, o) for o in HONEST_OUTPUTS] == HONEST_VERDICTS
    finally:
        pool.close()
    deadline = time.monotonic() + 5
    alive = [pid for pid in seen if Path(f"/proc/{pid}").exists()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _running(pid)]
    assert len(seen) >= 3 and not alive  # the zygote, the fork server, the program (and spares)


def _running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_realtime_signal_and_sigkill_are_the_programs_failure(pool, mode):
    for code in ("import signal\nsignal.raise_signal(40)\n", "import signal\nsignal.raise_signal(signal.SIGRTMAX)\n",
                 "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"):
        result = pool.run_program(code, [IOTest("", ""), CallTest("solve", (1,), 1)])
        assert (result.status, result.reward) == ("failed", 0.0), result
        assert "sandbox" not in " ".join(result.details)
    assert pool.stats.sandbox_failures == 0
    assert_honest_after(pool)


@pytest.mark.skipif(not ROOT, reason="runs this file as an unprivileged user; needs root to switch")
def test_attack_suite_as_an_unprivileged_user():
    """The whole file again as uid 65534, from a staged copy (:mod:`unprivileged_stage`) that nobody can read
    wherever the checkout and its venv live (a 0700 ``mktemp -d`` folder, ``/root``)."""
    from unprivileged_stage import NOBODY, first_closed_folder, interpreter_for_nobody, stage_for_nobody, stage_root

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is missing: cannot switch to an unprivileged uid")
    probe = subprocess.run([setpriv, *NOBODY, "unshare", "--user", "--map-root-user", "--net", "--pid", "--fork",
                            "--mount", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {probe.stderr.decode()[:200]}")
    python = interpreter_for_nobody(setpriv)
    if python is None:
        pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that uid 65534 can start: "
                    f"{first_closed_folder(Path(sys.executable).parent)} is closed to others and no system "
                    f"interpreter of this version exists")
    root = stage_root()
    if root is None:
        closed = first_closed_folder(Path(tempfile.gettempdir()))
        pytest.skip(f"no folder uid 65534 can enter to stage the test in: {closed} (from $TMPDIR) and /tmp, "
                    f"/var/tmp, /dev/shm are closed to others")
    repo = Path(__file__).resolve().parents[2]
    stage, staged_test = stage_for_nobody(Path(__file__), repo, root, extra_modules=("pyseccomp",))
    env = {"PATH": os.defpath, "HOME": str(stage / "home"), "PYTHONPATH": str(stage / "site"),
           "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "LANG": "C.UTF-8"}
    try:
        run = subprocess.run(
            [setpriv, *NOBODY, python, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
             f"--basetemp={stage / 'home' / 'base'}", "-rs", str(staged_test)],
            capture_output=True, text=True, env=env, cwd=stage, timeout=300)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    # every test ran in the user mode; only this one (it needs root) was skipped there
    assert " passed" in run.stdout and "1 skipped" in run.stdout and "error" not in run.stdout.lower(), tail
