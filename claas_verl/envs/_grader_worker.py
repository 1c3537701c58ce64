"""Sandbox zygote: a clean stdlib-only interpreter that forks one jailed child per call (issue 13).

Started by :mod:`claas_verl.envs.sandbox` as ``python -I -S <this file> <config json>``, normally under
``unshare --net --pid --ipc --fork --mount --mount-proc`` so that this process is PID 1 of a fresh PID
namespace, in a network namespace with no usable interface (only ``lo``, down) and a private mount
namespace. It never runs untrusted code itself. It keeps one *spare* child forked ahead of time, with a
fresh request pipe, result pipe and stdout pipe; the spare jails itself at once and only then waits for its
request, so neither the fork nor the jail is on a call's path. The spare, before it reads anything of the call:

1. starts its own session / process group (the wall-clock kill is ``killpg``),
2. points fd 0 and 2 at ``/dev/null`` and fd 1 at its stdout pipe, puts its result pipe on fd 3 and its
   request pipe on fd 4 (closed once read), and closes every other descriptor (the zygote's protocol pipes
   included),
3. ``chroot``\\ s into an empty read-only directory (no file, no ``/proc``, no device is visible; only the
   modules preloaded below can be imported) when it has the right to,
4. drops to ``nobody`` (uid/gid 65534, no supplementary groups) when started as root, and asks to be
   killed when the zygote dies (``PR_SET_PDEATHSIG``),
5. sets rlimits: CPU seconds, address space, no file writes (FSIZE 0), no processes (NPROC 0), few fds,
   no core dumps,
6. sets ``no_new_privs`` and loads a seccomp filter that fails process creation (fork/vfork/clone/clone3,
   execve/execveat), sockets (socket/socketpair/connect/bind/listen/accept), file creation and write-opens,
   ptrace/process_vm_*, kill, mount/namespace/chroot/keyring/bpf/io_uring calls, uid changes,
7. reads its one request, runs the code and writes *one* JSON reply that carries the call's nonce to fd 3,
   then ``_exit``\\ s. A grader's stdout is drained and dropped; a program's (IO tests) is returned.

The zygote reads at most ``max_output_bytes`` from the result and capture pipes, kills the child's process
group at the wall-clock limit or when the output limit is crossed, and answers the parent with a reply that
echoes the request nonce. Child replies are validated (JSON object, the call's nonce, typed fields); anything
else is reported as an error of that call, never passed on. Since each call has its own pipe and the zygote's
pipes are closed in the child, no call can write into another call's verdict.

Protocol with the parent on fd 0/1: a request is a length-prefixed (4-byte big-endian) JSON header (nonce,
kind, mode, limits) and a length-prefixed payload (code and inputs, JSON) that only the child parses; the
zygote hands the payload over and zeroes its buffer before forking the next spare, so a call never inherits
an earlier call's code or inputs. A reply is one length-prefixed JSON object.
This file imports only the standard library (and libseccomp through the pyseccomp file given in the config):
it runs outside the venv.
"""

# The modules marked F401 are preloaded: code in the jail can import only what is already in sys.modules.
import _posixsubprocess  # noqa: F401 - see socket
import _socket  # noqa: F401 - see socket
import abc  # noqa: F401
import array  # noqa: F401
import base64  # noqa: F401
import binascii  # noqa: F401
import bisect  # noqa: F401
import calendar  # noqa: F401
import cmath  # noqa: F401
import collections  # noqa: F401
import collections.abc  # noqa: F401
import copy  # noqa: F401
import ctypes
import dataclasses  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import difflib  # noqa: F401
import enum  # noqa: F401
import errno  # noqa: F401
import fcntl
import fractions  # noqa: F401
import functools  # noqa: F401
import gc  # noqa: F401
import hashlib  # noqa: F401
import heapq  # noqa: F401
import html  # noqa: F401
import importlib.util
import inspect
import io
import itertools  # noqa: F401
import json
import math  # noqa: F401
import numbers  # noqa: F401
import operator  # noqa: F401
import os
import random  # noqa: F401
import re  # noqa: F401
import resource
import select
import signal
import socket  # noqa: F401 - preloaded so that attacks meet the OS barriers, not a missing module
import statistics  # noqa: F401
import string  # noqa: F401
import struct
import subprocess  # noqa: F401 - see socket
import sys
import textwrap  # noqa: F401
import time
import traceback  # noqa: F401
import types  # noqa: F401
import typing  # noqa: F401
import unicodedata  # noqa: F401

unicodedata.normalize("NFKC", "x")  # load the unicode database now, not in the jail

NOBODY = 65534
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_RESULT_FD = 3
_REQUEST_FD = 4
_READY_TIMEOUT_S = 10.0  # sandbox._PARENT_MARGIN_S leaves room for it
_MAX_ERROR_CHARS = 2000

# errno values: EPERM 1, EACCES 13, ENOSYS 38
_DENY_EPERM = (
    "fork", "vfork", "clone", "execve", "execveat",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "kill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "shmget", "shmat", "msgget", "msgsnd", "semget", "mq_open",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "creat", "mkdir", "mkdirat", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "chown", "fchown", "fchownat", "lchown",
    "truncate", "ftruncate", "mknod", "mknodat", "setxattr", "lsetxattr", "fsetxattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "reboot", "swapon", "swapoff",
    "open_by_handle_at", "name_to_handle_at", "setuid", "setgid", "setreuid", "setregid", "setresuid",
    "setresgid", "setgroups", "personality",
)
_DENY_ENOSYS = ("clone3", "openat2")  # their flags live in a struct the filter cannot read: glibc falls back
_WRITE_OPEN_BITS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND)


def _load_seccomp(path):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("pyseccomp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build_filter(sc, own_pid):
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    # signals only to itself: no call can stop or kill the spare that will serve the next call
    f.add_rule(sc.ERRNO(1), "tgkill", sc.Arg(0, sc.NE, own_pid))
    for name in _DENY_EPERM:
        try:
            f.add_rule(sc.ERRNO(1), name)
        except Exception:  # noqa: BLE001 - a syscall this architecture does not have (e.g. fork on arm64)
            pass
    for name in _DENY_ENOSYS:
        try:
            f.add_rule(sc.ERRNO(38), name)
        except Exception:  # noqa: BLE001
            pass
    for name, flags_arg in (("open", 1), ("openat", 2)):
        for bit in _WRITE_OPEN_BITS:
            try:
                f.add_rule(sc.ERRNO(13), name, sc.Arg(flags_arg, sc.MASKED_EQ, bit, bit))
            except Exception:  # noqa: BLE001
                pass
    return f


class _Jail:
    """What every child applies to itself after fork (see the module docstring)."""

    def __init__(self, cfg):
        self.root = cfg.get("root")  # empty directory to chroot into, or None
        self.drop_uid = bool(cfg.get("drop_uid")) and os.geteuid() == 0
        self.cpu_s, self.memory_mb = int(cfg["cpu_s"]), int(cfg["memory_mb"])
        self.seccomp = _load_seccomp(cfg.get("pyseccomp"))
        self.filter = _build_filter(self.seccomp, os.getpid()) if self.seccomp is not None else None  # a check
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.devnull = os.open(os.devnull, os.O_RDWR)  # kept open: the jail has no /dev

    def enter(self, req_r, result_w, stdout_w):
        os.setsid()
        # move the three pipe ends out of the way first, so that no dup2 below clobbers another one
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in (stdout_w, result_w, req_r)]
        os.dup2(self.devnull, 0)
        os.dup2(high[0], 1)
        os.dup2(self.devnull, 2)
        os.dup2(high[1], _RESULT_FD)
        os.dup2(high[2], _REQUEST_FD)
        os.closerange(_REQUEST_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        if self.root:
            os.chroot(self.root)
            os.chdir("/")
        if self.drop_uid:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
        # after the uid change, which clears it: the child dies with the zygote even outside a PID namespace
        self.libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 1))
        mem = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        except (ValueError, OSError):
            pass  # does not bind root; the seccomp filter is what stops process creation
        if self.libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if self.seccomp is not None:
            _build_filter(self.seccomp, os.getpid()).load()


def _call_grader(fn, output, context):
    try:
        params = list(inspect.signature(fn).parameters.values())
        two = (len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2
               or any(p.kind == p.VAR_POSITIONAL for p in params))
    except (TypeError, ValueError):
        two = False
    return fn(output, context) if two else fn(output)


def _run_grader(req):
    ns = {"__name__": "ih_grader", "__builtins__": __builtins__}
    exec(compile(req["source"], "<grader>", "exec"), ns)
    fn = ns.get("grade_output_correct")
    if not callable(fn):
        return {"ok": False, "error": "grader source defines no callable grade_output_correct"}
    value = _call_grader(fn, req["output"], req["context"])
    if type(value) is not bool:
        return {"ok": False, "error": f"grade_output_correct returned {type(value).__name__}, expected bool"}
    return {"ok": True, "value": value}


def _err(e):
    return f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]


def _run_program(req):
    """``mode`` io: run as __main__ on stdin (stdout is captured by the zygote); call / assert: run tests."""
    mode = req["mode"]
    if mode == "io":
        sys.stdin = io.StringIO(req["stdin"])
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(req["source"], "<program>", "exec"), ns)
        except SystemExit as e:
            if e.code not in (None, 0):
                return {"ok": False, "error": f"SystemExit: {e.code!r}"[:_MAX_ERROR_CHARS]}
        finally:
            sys.stdout.flush()
        return {"ok": True}
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    exec(compile(req["source"], "<program>", "exec"), ns)
    results = []
    for test in req["tests"]:
        try:
            if mode == "call":
                value = ns[test["fn"]](*test["args"])
                results.append({"ok": True, "value": json.dumps(value, sort_keys=True, default=repr)})
            else:  # assert
                exec(compile(test["code"], "<test>", "exec"), ns)
                results.append({"ok": True})
        except BaseException as e:  # noqa: BLE001 - a failing test, not a failing sandbox
            results.append({"ok": False, "error": _err(e)})
    return {"ok": True, "results": results}


def _child(jail, req_r, result_w, stdout_w):
    """A spare: jail itself, say ``R`` on fd 3 (or ``E`` + why, and exit), wait for its one request on fd 4,
    run it, answer on fd 3, exit. The ready byte is read by the zygote before any request is handed over,
    so untrusted code can never fake a setup failure."""
    try:
        jail.enter(req_r, result_w, stdout_w)
    except BaseException as e:  # noqa: BLE001 - the jail could not be built: say so, run nothing
        try:
            os.write(result_w, b"E" + _err(e).encode("utf-8", "replace"))
        finally:
            os._exit(0)
    os.write(_RESULT_FD, b"R")
    nonce = None
    try:
        hdr = _read_exact(_REQUEST_FD, 4)
        req = json.loads(_read_exact(_REQUEST_FD, struct.unpack(">I", hdr)[0]).decode())
        os.close(_REQUEST_FD)
        nonce = req["nonce"]
        reply = _run_grader(req) if req["kind"] == "grade" else _run_program(req)
    except BaseException as e:  # noqa: BLE001 - any failure of the code is a reported error
        reply = {"ok": False, "error": _err(e)}
    reply["nonce"] = nonce
    try:
        data = json.dumps(reply).encode()
    except BaseException as e:  # noqa: BLE001
        data = json.dumps({"ok": False, "error": f"unencodable reply: {_err(e)}", "nonce": nonce}).encode()
    try:
        sys.stdout.flush()
        os.close(1)  # stdout is complete before the frame: the zygote need not wait for this process to exit
        data = struct.pack(">I", len(data)) + data
        while data:
            data = data[os.write(_RESULT_FD, data):]
    finally:
        os._exit(0)


def _kill_group(pid):
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _validate(buf, nonce, kind):
    """The child's frame -> a reply dict, or an error string when it is not a well-formed frame for this call."""
    try:
        reply = json.loads(buf.decode())
    except (ValueError, RecursionError):  # RecursionError: a frame nested thousands deep
        return None
    if not isinstance(reply, dict) or reply.get("nonce") != nonce or not isinstance(reply.get("ok"), bool):
        return None
    if not reply["ok"]:
        return {"ok": False, "error": str(reply.get("error", "error"))[:_MAX_ERROR_CHARS]}
    if kind == "grade":
        return {"ok": True, "value": reply["value"]} if isinstance(reply.get("value"), bool) else None
    if "results" in reply:
        res = reply["results"]
        if not isinstance(res, list) or not all(isinstance(r, dict) and isinstance(r.get("ok"), bool) for r in res):
            return None
        return {"ok": True, "results": [
            {"ok": r["ok"], "value": str(r["value"])} if r["ok"] and "value" in r
            else {"ok": r["ok"], "error": str(r.get("error", ""))[:_MAX_ERROR_CHARS]} if not r["ok"]
            else {"ok": True} for r in res]}
    return {"ok": True}


class _Spare:
    """A forked child that has jailed itself and waits for its request (fork and jail are off the call's path)."""

    def __init__(self, jail):
        req_r, self.req_w = os.pipe()
        self.result_r, result_w = os.pipe()
        self.cap_r, cap_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            _child(jail, req_r, result_w, cap_w)
        for fd in (req_r, result_w, cap_w):
            os.close(fd)

    def discard(self):
        _kill_group(self.pid)
        os.waitpid(self.pid, 0)
        for fd in (self.req_w, self.result_r, self.cap_r):
            os.close(fd)


def _await_ready(spare):
    """None when the spare jailed itself (it wrote ``R``), else why not: a sandbox failure, no code has run."""
    if not select.select([spare.result_r], [], [], _READY_TIMEOUT_S)[0]:
        return f"sandbox: the jail was not ready within {_READY_TIMEOUT_S}s"
    first = os.read(spare.result_r, 1)
    if first == b"R":
        return None
    rest = os.read(spare.result_r, _MAX_ERROR_CHARS) if first else b""
    return "sandbox: jail setup failed: " + rest.decode("utf-8", "replace")


def _hand_over(spare, payload):
    """Write the payload to the ready spare's request pipe, then zero it: no later spare inherits its content."""
    view = memoryview(payload)
    try:
        why = _await_ready(spare)
        if why is not None:
            return why
        os.write(spare.req_w, struct.pack(">I", len(payload)))
        while view:  # the spare reads as we write; a dead spare makes this fail (EPIPE), not hang
            view = view[os.write(spare.req_w, view):]
        return None
    except OSError as e:
        return f"sandbox: could not hand the request over: {e}"
    finally:
        view.release()
        payload[:] = bytes(len(payload))
        os.close(spare.req_w)


def _frame_complete(buf):
    return len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]


def _serve_one(spare, req, why, zombies):
    """Collect the frame and stdout of ``spare`` (its request handed over) within the limits.

    The child's frame is length-prefixed and written after it closed its stdout, so the reply goes back as
    soon as both are complete; the child is then killed and reaped later (``zombies``), off the call's path.
    """
    kind = req["kind"]
    keep_stdout = kind == "program" and req["mode"] == "io"
    limit = int(req["max_output_bytes"])
    deadline = time.monotonic() + float(req["timeout_s"])
    res, cap = spare.result_r, spare.cap_r
    bufs = {res: b"", cap: b""}
    open_fds = {res, cap}
    while why is None:
        done = _frame_complete(bufs[res]) and (cap not in open_fds or not keep_stdout)
        if done or not open_fds:
            break
        left = deadline - time.monotonic()
        ready = select.select(list(open_fds), [], [], left)[0] if left > 0 else []
        if not ready:
            why = f"timeout: exceeded {req['timeout_s']}s wall clock"
            break
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                continue
            if fd == cap and not keep_stdout:
                continue  # a grader's prints: drained and dropped
            bufs[fd] += chunk
            if len(bufs[fd]) > limit:
                why = f"output limit: more than {limit} bytes"
                break
    for fd in bufs:
        os.close(fd)
    if why is not None or _frame_complete(bufs[res]):
        _kill_group(spare.pid)
        zombies.append(spare.pid)
        status = None
    else:  # no complete frame and both pipes closed: the process is exiting; its status says why
        _, status = os.waitpid(spare.pid, 0)
    if why is not None:
        return {"ok": False, "error": why, "sandbox_failure": why.startswith("sandbox:")}
    frame = bufs[res]
    reply = _validate(frame[4:], req["nonce"], kind) if _frame_complete(frame) else None
    if reply is None:
        if status is not None and os.WIFSIGNALED(status):
            sig = signal.Signals(os.WTERMSIG(status)).name
            if sig == "SIGXCPU":  # RLIMIT_CPU and the wall clock race for a spinning program: both are a timeout
                return {"ok": False, "error": "timeout: exceeded the cpu time limit"}
            return {"ok": False, "error": f"process died: killed by {sig}"}
        if frame:
            return {"ok": False, "error": "malformed or forged reply frame", "forged": True}
        return {"ok": False, "error": f"process exited without a reply (status {status})"}
    if keep_stdout and reply["ok"]:
        reply["stdout"] = bufs[cap].decode("utf-8", "replace")
    return reply


def _reap(zombies):
    """Reap the killed children that have exited by now (WNOHANG); keep the others for later."""
    for pid in list(zombies):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            zombies.remove(pid)


def _read_into(fd, n):
    """``n`` bytes into a fresh bytearray (no intermediate bytes objects left on the heap), or None at EOF."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if not k:
            view.release()
            return None
        got += k
    view.release()
    return buf


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main():
    cfg = json.loads(sys.argv[1])
    inp, out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)  # stray prints from this process can never reach the protocol channel
    os.close(devnull)
    jail = _Jail(cfg)
    hello = json.dumps({"ready": True, "pid": os.getpid(), "seccomp": jail.filter is not None}).encode()
    os.write(out, struct.pack(">I", len(hello)) + hello)
    spare, zombies = _Spare(jail), []
    while True:
        # frame: 4-byte length + header JSON (nonce, kind, mode, limits), 4-byte length + payload (the code,
        # its inputs; only the child parses it)
        hdr = _read_exact(inp, 4)
        header = None if hdr is None else _read_exact(inp, struct.unpack(">I", hdr)[0])
        size = None if header is None else _read_exact(inp, 4)
        payload = None if size is None else _read_into(inp, struct.unpack(">I", size)[0])
        if payload is None:
            spare.discard()
            return
        req = json.loads(header.decode())
        current = spare
        why = _hand_over(current, payload)
        spare = _Spare(jail)  # the next call's spare forks and jails while this one runs
        try:
            reply = _serve_one(current, req, why, zombies)
        except Exception as e:  # noqa: BLE001 - reported to the parent as a sandbox failure of this call
            reply = {"ok": False, "error": f"zygote error: {_err(e)}", "sandbox_failure": True}
        reply["nonce"] = req["nonce"]
        data = json.dumps(reply).encode()
        data = struct.pack(">I", len(data)) + data
        while data:
            data = data[os.write(out, data):]
        _reap(zombies)

if __name__ == "__main__":
    main()
