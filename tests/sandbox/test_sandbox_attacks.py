"""Hostile graders against the OS sandbox, run as root like CI.

Every attack asserts (1) that its side effect did not happen, checked from outside the sandbox (a marker
file, a listener the test opened, a secret in another process's environment), and (2) that honest graders
run right after it on the same sandbox come back exactly aligned (T, T, F, T).
"""

import errno
import os
import platform
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from claas_verl.claas.envs import Grade, GraderError, SandboxedVerifier, Scenario
from claas_verl.sandbox import (
    GraderPool,
    GraderSandbox,
    IsolationSupport,
    SandboxLimits,
    SandboxUnavailable,
    probe_isolation,
    shared_pool,
)

# As root (CI, containers) the full sandbox must work, so these tests fail loudly if it does not; as a
# non-root user on a kernel without unprivileged user namespaces they are skipped, naming what is missing.
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and not probe_isolation().strong,
    reason=f"grader sandbox unavailable as non-root: missing {probe_isolation().missing()}",
)

SYS_CLONE = {"x86_64": 56, "aarch64": 220}[platform.machine()]
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[platform.machine()]
LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=2, memory_mb=256, max_output_bytes=1 << 16)
HONEST = "def grade_output_correct(output):\n    return output.startswith('ok')\n"
HONEST_OUTPUTS, HONEST_VERDICTS = ("ok 1", "ok 2", "bad 3", "ok 4"), [True, True, False, True]


def grader(body: str, imports: str = "") -> str:
    return f"{imports}\ndef grade_output_correct(output):\n" + textwrap.indent(textwrap.dedent(body), "    ")


def assert_aligned(sb):
    assert [sb.run(HONEST, o) for o in HONEST_OUTPUTS] == HONEST_VERDICTS


def verdict(sb, src, output="x"):
    """The attack's own outcome: True/False, or 'error' (GraderError -> reward None)."""
    try:
        return sb.run(src, output)
    except GraderError:
        return "error"


@pytest.fixture(scope="module")
def sb():
    iso = probe_isolation()
    if not iso.strong:
        pytest.fail(f"this machine should allow the full sandbox (CI runs as root): missing {iso.missing()}")
    s = GraderSandbox(LIMITS)
    yield s
    s.close()


@pytest.fixture()
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.05)
    yield srv

    # what reached it?
    srv.close()


def accepted_any(srv) -> bool:
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


def test_jail_view_uid_pid_fs_env(sb):
    """The child sees: uid nobody, a fresh PID namespace (few PIDs were ever used in it; its parent is the fork
    server, not the zygote, PID 1), an empty root, a clean environment."""
    src = grader("""
        return (os.getuid() == 65534 and os.geteuid() == 65534 and os.getgid() == 65534 and os.getgroups() == []
                and 1 < os.getppid() < os.getpid() < 64 and os.listdir('/') == [] and not os.path.exists('/proc/self')
                and set(os.environ) <= {'PATH', 'LANG', 'LC_ALL'}
                and sorted(int(f) for f in range(64) if _open(f)) == [0, 1, 2, 3])
    """, "import os, socket\ndef _open(fd):\n    try:\n        os.fstat(fd)\n        return True\n"
         "    except OSError:\n        return False\n")
    assert sb.run(src, "x") is True
    # seen from outside: the zygote (PID 1 of its namespace, child of `unshare`) has its own net/pid/mnt namespaces
    zygote = int(open(f"/proc/{sb._proc.pid}/task/{sb._proc.pid}/children").read().split()[0])
    for ns in ("net", "pid_for_children", "mnt"):
        assert os.readlink(f"/proc/{zygote}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns


@pytest.mark.parametrize("how", ["os.system", "subprocess", "fork_exec", "os.fork", "posix_spawn", "os.execv",
                                 "ctypes.fork", "ctypes.syscall_clone", "fork_loop"])
def test_process_creation_fails(sb, tmp_path, how):
    marker = tmp_path / "pwned"
    cmd = f"id > {marker}"
    body = {
        "os.system": f"return os.system({cmd!r}) == 0",
        "subprocess": f"subprocess.run(['/bin/sh', '-c', {cmd!r}])\nreturn True",
        "fork_exec": f"subprocess.Popen(['/bin/sh', '-c', {cmd!r}], close_fds=False)\nreturn True",
        "os.fork": "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nreturn True",
        "posix_spawn": f"os.posix_spawn('/bin/sh', ['sh', '-c', {cmd!r}], {{}})\nreturn True",
        "os.execv": f"os.execv('/bin/sh', ['sh', '-c', {cmd!r}])",
        # libc fork, then exec in the child if it ever ran; the grader reports the errno it saw
        "ctypes.fork": ("pid = libc.fork()\nif pid == 0:\n"
                        f"    libc.execl(b'/bin/sh', b'sh', b'-c', {cmd.encode()!r}, None)\n    os._exit(0)\n"
                        "return pid == -1 and ctypes.get_errno() == errno.EPERM"),
        # the raw clone syscall (SIGCHLD as flags: a plain fork), bypassing glibc
        "ctypes.syscall_clone": (f"pid = libc.syscall({SYS_CLONE}, 17, 0, 0, 0, 0)\nif pid == 0:\n    os._exit(0)\n"
                                 "return pid == -1 and ctypes.get_errno() == errno.EPERM"),
        # a bounded fork loop (children exit at once), so that even a broken jail cannot hurt the machine
        "fork_loop": "for _ in range(200):\n    if os.fork() == 0:\n        os._exit(0)\nreturn True",
    }[how]
    src = grader(body, "import os, subprocess, ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)")
    t0 = time.monotonic()
    outcome = verdict(sb, src)
    assert time.monotonic() - t0 < LIMITS.timeout_s  # refused at once, not stopped by the wall-clock kill
    assert outcome in (("error",) if how not in ("os.system", "ctypes.fork", "ctypes.syscall_clone") else
                       (False,) if how == "os.system" else (True,)), outcome
    assert not marker.exists()
    assert_aligned(sb)


@pytest.mark.parametrize("how", ["socket", "_socket", "ctypes", "udp"])
def test_network_is_unreachable(sb, listener, how):
    port = listener.getsockname()[1]
    body = {
        "socket": f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\nreturn True",
        "_socket": f"s = _socket.socket()\ns.connect(('127.0.0.1', {port}))\nreturn True",
        "ctypes": "fd = libc.socket(2, 1, 0)\nreturn fd == -1 and ctypes.get_errno() == errno.EPERM",
        "udp": f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))\nreturn True",
    }[how]
    src = grader(body, "import socket, _socket, ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)")
    assert verdict(sb, src) == (True if how == "ctypes" else "error")
    assert not accepted_any(listener)
    assert_aligned(sb)


def test_secret_in_another_process_environment_is_unreadable(sb):
    secret = "s3cr3t-" + os.urandom(6).hex()
    victim = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                              env={**os.environ, "CLAAS_TRAINER_SECRET": secret}, stdout=subprocess.PIPE)
    try:
        assert victim.stdout.readline() == b"up\n"
        with open(f"/proc/{victim.pid}/environ", "rb") as f:
            assert secret.encode() in f.read()  # readable from outside: the attack is meaningful
        src = grader(f"""
            found = []
            for path in ('/proc/{victim.pid}/environ', '/proc/{os.getpid()}/environ', '/proc/1/environ',
                         '/proc/self/environ', '/proc/self/root/proc/{victim.pid}/environ'):
                try:
                    found.append(open(path, 'rb').read())
                except OSError:
                    pass
            return b'{secret}' in b''.join(found) or '{secret}' in str(os.environ)
        """, "import os")
        assert sb.run(src, "x") is False
        os.environ["CLAAS_TRAINER_SECRET"] = secret  # also in this process's live environment
        try:
            with GraderSandbox(LIMITS) as fresh:  # a zygote started after the variable was set
                assert fresh.run(src, "x") is False
        finally:
            del os.environ["CLAAS_TRAINER_SECRET"]
    finally:
        victim.kill()
        victim.wait()
    assert_aligned(sb)


def test_file_writes_and_escapes_fail(sb, tmp_path):
    marker = tmp_path / "pwned"
    for body in (f"open({str(marker)!r}, 'w').write('x')", f"os.open({str(marker)!r}, os.O_CREAT | os.O_WRONLY)",
                 "os.mkdir('/x')", "os.chroot('/')", "os.chdir('..'); os.chroot('.')",
                 "os.setuid(0)", "assert libc.unshare(0x20000000) == 0"):
        src = grader(body + "\nreturn True", "import os, ctypes\nlibc = ctypes.CDLL(None, use_errno=True)")
        assert verdict(sb, src) == "error", body
    assert not marker.exists()
    assert_aligned(sb)


FORGE = """
import json, os, struct
def forge(value, nonce='0' * 32):
    frame = json.dumps({'ok': True, 'value': value, 'nonce': nonce}).encode()
    for fd in range(1024):
        for data in (struct.pack('>I', len(frame)) + frame, frame):
            try:
                os.write(fd, data)
            except OSError:
                pass
"""


def test_writing_to_every_descriptor_cannot_forge_or_shift_verdicts(sb):
    src = FORGE + "def grade_output_correct(output):\n    forge(True)\n    return False\n"
    assert verdict(sb, src) in (False, "error")  # a forged frame breaks its own reply; never True
    assert_aligned(sb)
    # the real nonce, read from the child's own memory: it can only restate its own verdict
    steal = FORGE + textwrap.dedent("""
        import gc
        def grade_output_correct(output):
            nonce = [o['nonce'] for o in gc.get_objects() if isinstance(o, dict) and 'nonce' in o
                     and isinstance(o['nonce'], str) and len(o['nonce']) == 32][0]
            forge(True, nonce)
            forge(True, nonce)
            return False
    """)
    assert verdict(sb, steal) in (False, "error")
    assert_aligned(sb)


def test_kill_and_tamper_attempts(sb):
    for body in ("os.kill(1, 9)", "os.kill(os.getppid(), 9)", "os.killpg(0, 9)",
                 "import json\njson.dumps = lambda *a, **k: '{'\nreturn True",
                 "os.close(3)\nreturn True", "os.dup2(0, 3)\nreturn True"):
        src = grader(body + "\nreturn True", "import os")
        assert verdict(sb, src) == "error", body
    assert sb.stats.restarts == 0  # the zygote survived every attempt
    assert_aligned(sb)


def test_a_call_cannot_stop_or_kill_the_spare_that_serves_the_next_call(sb):
    """Each call's process coexists with the pre-forked spare of the next call (same uid): raw tgkill/kill with
    SIGSTOP/SIGKILL at every PID of the namespace must fail, and the next honest calls come back exactly."""
    src = grader(f"""
        time.sleep(0.5)  # the zygote forks the next spare just after handing this call over
        hits = 0
        for pid in range(1, 300):
            if pid == os.getpid():
                continue
            for sig in (19, 9):  # SIGSTOP, SIGKILL
                hits += libc.syscall({SYS_TGKILL}, pid, pid, sig) == 0
                try:
                    os.kill(pid, sig)
                    hits += 1
                except OSError:
                    pass
        shm = libc.shmget(0, 4096, 0o1666)
        return hits == 0 and shm == -1
    """, "import os, ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)")
    assert sb.run(src, "x") is True
    assert_aligned(sb)
    assert sb.stats.sandbox_failures == 0


@pytest.mark.parametrize("body,why", [
    ("while True:\n    pass", "timeout|cpu time"),
    ("import time\ntime.sleep(60)", "timeout"),
    ("x = bytearray(1 << 31)", "MemoryError"),
    ("x = []\nwhile True:\n    x.append(' ' * (1 << 20))", "MemoryError|killed"),
    ("os.write(3, b'x' * (1 << 24))", "output limit"),
    ("raise ValueError('e' * (1 << 22))", "ValueError"),
    ("print('y' * (1 << 24))\nreturn True", None),
])
def test_resource_attacks(tight, body, why):
    s = tight
    if True:
        src = grader(body, "import os")
        t0 = time.monotonic()
        if why is None:
            assert s.run(src, "x") is True  # printing to /dev/null is harmless
        else:
            with pytest.raises(GraderError, match=why) as e:
                s.run(src, "x")
            assert len(str(e.value)) <= 2100
        assert time.monotonic() - t0 < 10
        assert_aligned(s)
        assert s.stats.sandbox_failures == 0


@pytest.fixture(scope="module")
def tight():
    s = GraderSandbox(SandboxLimits(timeout_s=1.5, cpu_s=1, memory_mb=256, max_output_bytes=1 << 16))
    yield s
    s.close()


@pytest.mark.parametrize("ret", ["1", "None", "'True'", "0.0", "[True]", "type('I', (int,), {})(1)",
                                 "type('B', (), {'__bool__': lambda s: True})()"])
def test_non_bool_returns_are_errors(sb, ret):
    with pytest.raises(GraderError, match="expected bool"):
        sb.run(grader(f"return {ret}"), "x")
    assert_aligned(sb)


def test_protocol_errors_are_none_and_counted_never_a_crash(tmp_path):
    """A zygote that answers with another call's nonce, garbage, or dies: GraderError -> Grade(None), counted."""
    fake = tmp_path / "fake_zygote.py"
    fake.write_text(textwrap.dedent("""
        import json, os, struct, sys
        mode = sys.argv[1]
        hello = json.dumps({'ready': True, 'seccomp': True}).encode()
        os.write(1, struct.pack('>I', len(hello)) + hello)
        n = struct.unpack('>I', os.read(0, 4))[0]
        os.read(0, n)
        body = {'wrong_nonce': json.dumps({'ok': True, 'value': True, 'nonce': 'f' * 32}).encode(),
                'garbage': b'[1, 2',
                'not_object': b'[]'}.get(mode)
        if body is not None:
            os.write(1, struct.pack('>I', len(body)) + body)
        if mode == 'huge':
            os.write(1, struct.pack('>I', 1 << 30))
    """))
    sb = GraderSandbox(LIMITS)
    try:
        for i, mode in enumerate(("wrong_nonce", "garbage", "not_object", "die", "huge"), start=1):
            sb._proc = subprocess.Popen([sys.executable, str(fake), mode], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
            sb._read_frame(time.monotonic() + 10)
            with pytest.raises(GraderError, match="sandbox failed"):
                sb.run(HONEST, "ok")
            assert sb.stats.sandbox_failures == i
            assert sb._proc is None  # recycled
        assert_aligned(sb)  # a real zygote again
        # through the scenario API the same failure is reward None, never an exception
        lim = SandboxLimits(timeout_s=9.0, cpu_s=2, memory_mb=256)
        scen = Scenario("p", "rules", ("u",), SandboxedVerifier(HONEST, limits=lim))
        victim = shared_pool(lim)._all[0]
        victim._proc = subprocess.Popen([sys.executable, str(fake), "wrong_nonce"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        victim._read_frame(time.monotonic() + 10)
        assert scen.grade("ok", 0) == Grade(None, None)
        assert victim.stats.sandbox_failures == 1
        assert scen.grade("ok", 0) == Grade(1.0, None)
        shared_pool(lim).close()
    finally:
        sb.close()


def test_refuses_without_namespaces_unless_opted_in(caplog):
    real = probe_isolation()
    no_ns = IsolationSupport((), real.seccomp_path, real.root, "forced by the test")
    no_seccomp = IsolationSupport(real.unshare_args, None, real.root)
    for iso, what in ((no_ns, "namespaces"), (no_seccomp, "seccomp")):
        with pytest.raises(SandboxUnavailable, match=f"(?s){what}.*allow_weak_isolation"):
            GraderSandbox(LIMITS, isolation=iso)
        with pytest.raises(SandboxUnavailable):
            GraderPool(2, LIMITS, isolation=iso)
    weak = SandboxLimits(timeout_s=10.0, cpu_s=2, memory_mb=256, allow_weak_isolation=True)
    with caplog.at_level("WARNING", logger="claas_verl.sandbox"):
        with GraderSandbox(weak, isolation=no_ns) as s:
            assert_aligned(s)
            # without namespaces the child is in the host PID namespace: what is left still holds here (root)
            probe = grader("import os, errno\ntry:\n    os.fork()\nexcept PermissionError:\n"
                           "    return os.getuid() == 65534 and os.getppid() != 1 and os.listdir('/') == []\n"
                           "return False")
            assert s.run(probe, "x") is True
    assert any("WEAK ISOLATION" in r.getMessage() for r in caplog.records)


def test_pool_grades_in_parallel_and_stays_aligned():
    sleepy = grader("import time\ntime.sleep(0.4)\nreturn output.startswith('ok')")
    with GraderPool(4, LIMITS) as pool:
        pool.start()
        calls = [(sleepy if i % 2 else HONEST, o, "") for i in range(2) for o in HONEST_OUTPUTS]
        t0 = time.monotonic()
        out = pool.map(calls)
        wall = time.monotonic() - t0
        assert out == HONEST_VERDICTS * 2
        assert wall < 4 * 0.4 * 0.8, wall  # serial would be 1.6 s of sleeping alone
        bad = pool.map([(grader("raise KeyError('k')"), "x", ""), (HONEST, "ok", "")])
        assert isinstance(bad[0], GraderError) and bad[1] is True
        assert pool.stats.calls == 10 and pool.stats.code_errors == 1 and pool.stats.sandbox_failures == 0


def test_errno_module_is_available_in_the_jail(sb):
    assert sb.run(grader(f"return errno.EPERM == {errno.EPERM}", "import errno"), "x") is True


def test_ih_challenge_env_refuses_on_a_machine_without_namespaces(monkeypatch, caplog):
    from pathlib import Path

    from claas_verl.claas.envs import make_environment
    from claas_verl.sandbox import isolation as isolation_mod

    sample = Path(__file__).resolve().parents[2] / "examples" / "data" / "ih_challenge_sample.jsonl"
    real = probe_isolation()
    monkeypatch.setattr(isolation_mod, "probe_isolation", lambda: IsolationSupport((), real.seccomp_path, real.root,
                                                                                     "forced by the test"))
    with pytest.raises(SandboxUnavailable, match="allow_weak_isolation"):
        make_environment("ih_challenge", path=sample)
    weak = {"timeout_s": 10.0, "cpu_s": 2, "memory_mb": 256, "allow_weak_isolation": True}
    with caplog.at_level("WARNING", logger="claas_verl.sandbox"):
        env = make_environment("ih_challenge", path=sample, n_workers=2, sandbox=weak)
        try:
            s1 = env.scenarios()[0]
            assert s1.grade("I cannot share that.", 0) == Grade(1.0, None)
            assert s1.grade("It is b l u e f i n 4 2", 1).reward == 0.0
        finally:
            env.close()
    assert any("WEAK ISOLATION" in r.getMessage() for r in caplog.records)
