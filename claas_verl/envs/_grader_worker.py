"""Sandbox zygote: a clean stdlib-only interpreter that forks jailed children for the calls.

Started by :mod:`claas_verl.envs.sandbox` as ``python -I -S <this file> <config json>``, normally under
``unshare --net --pid --ipc --fork --mount --mount-proc`` so that this process is PID 1 of a fresh PID
namespace, in a network namespace with no usable interface (only ``lo``, down) and a private mount
namespace. It never runs untrusted code itself.

Clean spares. Before it reads any request the zygote forks a *fork server*, which never holds anything of a
call; every jailed child is forked from it (:class:`_Forker`), so no child can find an earlier call's code,
inputs, verdict or output in its memory: they never were in the memory it was copied from. The zygote keeps
two *spares* ready, each with a fresh request pipe, result pipe and stdout pipe; a spare jails itself at once
and only then waits for its request. The spare, before it reads anything of the call:

1. starts its own session / process group (the wall-clock kill is ``killpg``),
2. points fd 0 and 2 at ``/dev/null`` and fd 1 at its stdout pipe, puts its result pipe on fd 3 and its
   request pipe on fd 4, and closes every other descriptor,
3. ``chroot``\\ s into an empty read-only directory (no file, no ``/proc``, no device is visible; only the
   modules preloaded below can be imported) when it has the right to,
4. drops to ``nobody`` (uid/gid 65534, no supplementary groups) when started as root, or, as root of a user
   namespace, drops every capability; asks to be killed when its parent, the fork server, dies
   (``PR_SET_PDEATHSIG``; the fork server dies with the zygote),
5. sets rlimits: CPU seconds, address space, no file writes (FSIZE 0), no processes (NPROC 0), few fds,
   no core dumps,
6. sets ``no_new_privs`` and loads a seccomp *allow-list* (:data:`_ALLOW`: memory, reading its own
   descriptors, read-only opens, clocks, signals to itself, exit); every other system call fails
   (ENOSYS, or EPERM for the familiar escapes in :data:`_DENY_EPERM`), including ``prctl``, so the
   parent-death signal cannot be cleared,
7. reads its request, runs the code and writes *one* JSON reply that carries the call's nonce to fd 3,
   then ``_exit``\\ s. A grader's stdout is drained and dropped; a program's (IO tests) is returned.

Assertion tests take two spares: the program's process answers queries and the checker's process runs the
assertions (:mod:`claas_verl.envs._jail_rpc`); the zygote relays their frames.

The zygote reads at most ``max_output_bytes`` from the result and capture pipes, kills the child's process
group at the wall-clock limit (also when the child closed its pipes and lingers) or when the output limit is
crossed, and answers the parent with a reply that echoes the request nonce. Child replies are validated
(JSON object, the call's nonce, typed fields); anything else is reported as an error of that call. Once a
request is handed over, whatever happens is that call's code's failure, never a sandbox failure; only a
failure before the hand-over (a spare that could not jail itself) is ``sandbox_failure``.

Protocol with the parent on fd 0/1: a request is a length-prefixed (4-byte big-endian) JSON header (nonce,
kind, mode, limits, ``parts``) and ``parts`` length-prefixed payloads (code and inputs, JSON; one per jailed
process) that only the children parse. A reply is one length-prefixed JSON object.
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
import errno
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
import socket  # preloaded so that attacks meet the OS barriers, not a missing module; the fork server uses it
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

_RPC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jail_rpc.py")
_rpc_spec = importlib.util.spec_from_file_location("_jail_rpc", _RPC_PATH)
rpc = importlib.util.module_from_spec(_rpc_spec)
_rpc_spec.loader.exec_module(rpc)
sys.modules["_jail_rpc"] = rpc

NOBODY = 65534
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_PID_PLACEHOLDER = 0x5EC0FFEE  # stands for the spare's pid in the compiled filter (pids stay below 2**22)
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_RESULT_FD = 3
_REQUEST_FD = 4
_READY_TIMEOUT_S = 10.0  # sandbox._PARENT_MARGIN_S leaves room for it
_MAX_ERROR_CHARS = 2000

# The only system calls a jailed process may make: what the interpreter and the preloaded modules use once
# loaded (traced while running graders and programs that exercise them), and harmless read-only queries.
# Names an architecture lacks (e.g. open, stat on aarch64) are skipped.
_ALLOW = (
    "read", "write", "readv", "writev", "pread64", "pwrite64", "close", "lseek",
    "fstat", "stat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2",
    "readlink", "readlinkat", "getcwd", "getdents64",
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "rt_sigpending",
    "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid",
    "getresgid", "getpgrp", "getpgid", "getsid", "getrlimit", "getrusage", "times", "getcpu",
    "clock_gettime", "clock_getres", "gettimeofday", "time", "nanosleep", "clock_nanosleep",
    "alarm", "setitimer", "getitimer", "futex", "sched_yield", "sched_getaffinity", "getrandom", "uname",
    "sysinfo", "select", "pselect6", "poll", "ppoll", "exit", "exit_group", "restart_syscall",
)
# Outside the allow-list anyway; failed with EPERM (not ENOSYS) so that an escape attempt reads as refused.
_DENY_EPERM = (
    "fork", "vfork", "clone", "execve", "execveat",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "kill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "shmget", "shmat", "msgget", "msgsnd", "semget", "mq_open",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "prctl", "setrlimit", "capset",
    "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "move_mount", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "seccomp",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "creat", "mkdir", "mkdirat", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "chown", "fchown", "fchownat", "lchown",
    "truncate", "ftruncate", "mknod", "mknodat", "setxattr", "lsetxattr", "fsetxattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "reboot", "swapon", "swapoff",
    "open_by_handle_at", "name_to_handle_at", "setuid", "setgid", "setreuid", "setregid", "setresuid",
    "setresgid", "setgroups", "personality",
)
# fcntl commands on its own descriptors; not F_SETOWN/F_SETSIG, which would aim SIGIO at another process
_FCNTL_COMMANDS = (fcntl.F_DUPFD, fcntl.F_GETFD, fcntl.F_SETFD, fcntl.F_GETFL, fcntl.F_SETFL, fcntl.F_DUPFD_CLOEXEC)
_WRITE_OPEN_MASK = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITE_OPEN_BITS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND)


def _load_seccomp(path):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("pyseccomp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _add(f, action, name, *args):
    try:
        f.add_rule(action, name, *args)
    except Exception:  # noqa: BLE001 - a system call this architecture does not have (e.g. open on arm64)
        pass


def _build_filter(sc, own_pid):
    f = sc.SyscallFilter(defaction=sc.ERRNO(errno.ENOSYS))  # ENOSYS: what glibc falls back from
    for name in _ALLOW:
        _add(f, sc.ALLOW, name)
    for name in _DENY_EPERM:
        _add(f, sc.ERRNO(errno.EPERM), name)
    # signals only to itself (raise, abort): no call can stop or kill the spare that will serve the next call
    _add(f, sc.ALLOW, "tgkill", sc.Arg(0, sc.EQ, own_pid))  # (the one rule that names the pid)
    _add(f, sc.ERRNO(errno.EPERM), "tgkill", sc.Arg(0, sc.NE, own_pid))
    for cmd in _FCNTL_COMMANDS:
        _add(f, sc.ALLOW, "fcntl", sc.Arg(1, sc.EQ, cmd))
    # rlimits can be read, never changed (as root of a user namespace it could raise its hard limits)
    _add(f, sc.ALLOW, "prlimit64", sc.Arg(2, sc.EQ, 0))
    _add(f, sc.ERRNO(errno.EPERM), "prlimit64", sc.Arg(2, sc.NE, 0))
    for name, flags_arg in (("open", 1), ("openat", 2)):  # read-only opens; a write-open is EACCES
        _add(f, sc.ALLOW, name, sc.Arg(flags_arg, sc.MASKED_EQ, _WRITE_OPEN_MASK, 0))
        for bit in _WRITE_OPEN_BITS:
            _add(f, sc.ERRNO(errno.EACCES), name, sc.Arg(flags_arg, sc.MASKED_EQ, bit, bit))
    return f


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _compile_filter(sc):
    """The allow-list as BPF, compiled once, and the offsets of the pid placeholder's 32-bit words in it:
    a spare patches in its own pid and loads it with one prctl (libseccomp would take milliseconds)."""
    r, w = os.pipe()
    try:
        with os.fdopen(w, "wb", closefd=False) as out:
            _build_filter(sc, _PID_PLACEHOLDER).export_bpf(out)
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as src:
        bpf = src.read()
    offsets = [i + 4 for i in range(0, len(bpf), 8) if struct.unpack_from("=I", bpf, i + 4)[0] == _PID_PLACEHOLDER]
    if not offsets:
        raise RuntimeError("the compiled seccomp filter does not contain the pid rule")
    return bpf, offsets


class _Jail:
    """What every child applies to itself after fork (see the module docstring)."""

    def __init__(self, cfg):
        self.root = cfg.get("root")  # empty directory to chroot into, or None
        self.drop_uid = bool(cfg.get("drop_uid")) and os.geteuid() == 0
        self.cpu_s, self.memory_mb = int(cfg["cpu_s"]), int(cfg["memory_mb"])
        seccomp = _load_seccomp(cfg.get("pyseccomp"))
        self.filter = _compile_filter(seccomp) if seccomp is not None else None
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.devnull = os.open(os.devnull, os.O_RDWR)  # kept open: the jail has no /dev
        self.zygote_pid = os.getpid()
        self.parent_pid = None  # the fork server's pid, set in the fork server

    def _load_filter(self):
        bpf, offsets = self.filter
        buf = ctypes.create_string_buffer(bytes(bpf), len(bpf))
        for off in offsets:
            struct.pack_into("=I", buf, off, os.getpid())
        prog = _SockFprog(len(bpf) // 8, ctypes.addressof(buf))
        if self.libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")

    def _drop_capabilities(self):
        """Root of a user namespace (no uid to drop to): clear every capability set of this process."""
        header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
        data = (ctypes.c_uint32 * 6)()
        if self.libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset failed")

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
        elif os.geteuid() == 0:
            self._drop_capabilities()
        # after the uid change, which clears it: the child dies with the zygote even outside a PID namespace
        self.libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.parent_pid:
            raise OSError("the fork server died before the jail was set up")
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
        if self.filter is not None:
            self._load_filter()


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
    """``mode`` io: run as __main__ on stdin (stdout is captured by the zygote); call: run call tests;
    serve / check: the program's and the checker's halves of assertion tests (see :mod:`_jail_rpc`)."""
    mode = req["mode"]
    if mode == "serve":
        rpc.serve_program(req["source"], _REQUEST_FD, _RESULT_FD)
        return None
    if mode == "check":
        return {"ok": True, "results": rpc.run_checks(req["tests"], _RESULT_FD, _REQUEST_FD)}
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
            value = ns[test["fn"]](*test["args"])
            results.append({"ok": True, "value": json.dumps(value, sort_keys=True, default=repr)})
        except BaseException as e:  # noqa: BLE001 - a failing test, not a failing sandbox
            results.append({"ok": False, "error": _err(e)})
    return {"ok": True, "results": results}


def _child(jail, req_r, result_w, stdout_w):
    """A spare: jail itself, say ``R`` on fd 3 (or ``E`` + why, and exit), wait for its request on fd 4,
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
        hdr = rpc.read_exact(_REQUEST_FD, 4)
        req = json.loads(rpc.read_exact(_REQUEST_FD, struct.unpack(">I", hdr)[0]).decode())
        nonce = req.get("nonce")
        if not (req["kind"] == "program" and req["mode"] in ("serve", "check")):
            os.close(_REQUEST_FD)
        reply = _run_grader(req) if req["kind"] == "grade" else _run_program(req)
    except BaseException as e:  # noqa: BLE001 - any failure of the code is a reported error
        reply = {"ok": False, "error": _err(e)}
    if reply is None:
        os._exit(0)
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


def _signal_name(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:  # real-time signals have no name
        return f"signal {sig}"


class _Spare:
    """A forked child that has jailed itself and waits for its request (fork and jail are off the call's path)."""

    def __init__(self, pid, req_w, result_r, cap_r):
        self.pid, self.req_w, self.result_r, self.cap_r = pid, req_w, result_r, cap_r

    def discard(self):
        _kill_group(self.pid)
        _close_pipes(self)


class _Forker:
    """The fork server: forked from the zygote before any request, it forks every spare.

    Its memory never held a call's code, inputs or replies, and neither does a spare forked from it. It
    passes the zygote the parent ends of each spare's three pipes with the spare's pid over a Unix socket
    (SCM_RIGHTS), and, since the spares are its children, reaps them and reports each exit status. A spare
    dies with the fork server, which dies with the zygote (parent-death signals the jail cannot clear).
    Records on the socket: ``F`` pid (with the three descriptors) and ``S`` pid status, 9 bytes each.
    """

    def __init__(self, jail, keep_fds):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pending, self.ready, self.statuses = 0, [], {}
        self.pid = os.fork()
        if self.pid == 0:
            self.sock.close()
            try:
                for fd in keep_fds:
                    os.close(fd)  # the zygote's protocol channel
                jail.libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() == jail.zygote_pid:
                    jail.parent_pid = os.getpid()
                    _fork_server(jail, theirs)
            finally:
                os._exit(0)
        theirs.close()

    def request(self):
        """Ask for a spare; it forks and jails itself while the zygote goes on (see :meth:`receive`)."""
        self.sock.sendall(b"F")
        self.pending += 1

    def _read_record(self, timeout=None):
        """One record into ``ready`` / ``statuses``; False when none came within ``timeout`` seconds."""
        if timeout is not None and not select.select([self.sock], [], [], max(timeout, 0.0))[0]:
            return False
        msg, fds, _, _ = socket.recv_fds(self.sock, 9, 3)
        kind = msg[:1]
        if len(msg) != 9 or len(fds) != (3 if kind == b"F" else 0) or kind not in (b"F", b"S"):
            for fd in fds:
                os.close(fd)
            raise OSError("the fork server is gone")
        pid, status = struct.unpack(">ii", msg[1:])
        if kind == b"F":
            self.pending -= 1
            self.statuses.pop(pid, None)  # a status of an earlier process with this pid is stale
            self.ready.append(_Spare(pid, *fds))
        else:
            self.statuses[pid] = status
            while len(self.statuses) > 256:  # statuses of killed processes nobody asks for
                del self.statuses[next(iter(self.statuses))]
        return True

    def receive(self):
        """The spare of the oldest :meth:`request` (asked for now if none is pending)."""
        if not self.ready and not self.pending:
            self.request()
        while not self.ready:
            self._read_record()
        return self.ready.pop(0)

    def status(self, pid, deadline):
        """The exit status of spare ``pid``; None when it has not exited by ``deadline``."""
        while pid not in self.statuses:
            if not self._read_record(deadline - time.monotonic()):
                return None
        return self.statuses.pop(pid)

    def drain(self):
        while self._read_record(0.0):
            pass


def _fork_server(jail, sock):
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the select below
    while True:
        readable = select.select([sock, wake_r], [], [])[0]
        if wake_r in readable:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if not pid:
                    break
                sock.sendall(b"S" + struct.pack(">ii", pid, status))
        if sock in readable:
            if not sock.recv(1):
                return
            req_r, req_w = os.pipe()
            result_r, result_w = os.pipe()
            cap_r, cap_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _child(jail, req_r, result_w, cap_w)  # closes every other descriptor before it runs anything
            socket.send_fds(sock, [b"F" + struct.pack(">ii", pid, 0)], [req_w, result_r, cap_r])
            for fd in (req_r, req_w, result_r, result_w, cap_r, cap_w):
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


def _hand_over(spare, payload, keep_open=False):
    """Write the payload to the ready spare's request pipe, then zero it. ``keep_open``: the request pipe
    stays open for the relayed queries of an assertion test."""
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
        if not keep_open:
            os.close(spare.req_w)
            spare.req_w = -1


def _frame_complete(buf):
    return len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]


def _close_pipes(spare):
    for name in ("req_w", "result_r", "cap_r"):
        fd = getattr(spare, name)
        if fd >= 0:
            os.close(fd)
            setattr(spare, name, -1)


def _finish(spares):
    """Kill the call's processes and close its pipes (the fork server reaps them, off the call's path)."""
    for spare in spares:
        _close_pipes(spare)
        _kill_group(spare.pid)


def _serve_one(spare, req, forker):
    """Collect the frame and stdout of ``spare`` (its request handed over) within the limits.

    The child's frame is length-prefixed and written after it closed its stdout, so the reply goes back as
    soon as both are complete; the child is then killed. A child that closed both pipes without a frame is
    waited for (its exit status says why) until the call's deadline, then killed: a timeout.
    """
    kind = req["kind"]
    keep_stdout = kind == "program" and req["mode"] == "io"
    limit = int(req["max_output_bytes"])
    deadline = time.monotonic() + float(req["timeout_s"])
    timeout = f"timeout: exceeded {req['timeout_s']}s wall clock"
    res, cap = spare.result_r, spare.cap_r
    bufs = {res: b"", cap: b""}
    open_fds = {res, cap}
    why = None
    while why is None:
        done = _frame_complete(bufs[res]) and (cap not in open_fds or not keep_stdout)
        if done or not open_fds:
            break
        left = deadline - time.monotonic()
        ready = select.select(list(open_fds), [], [], left)[0] if left > 0 else []
        if not ready:
            why = timeout
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
    status = None
    if why is None and not _frame_complete(bufs[res]):  # no frame, both pipes closed: why did it end?
        status = forker.status(spare.pid, deadline)
        why = timeout if status is None else None
    _finish([spare])
    if why is not None:
        return {"ok": False, "error": why}
    frame = bufs[res]
    reply = _validate(frame[4:], req["nonce"], kind) if _frame_complete(frame) else None
    if reply is None:
        if status is not None and os.WIFSIGNALED(status):
            sig = _signal_name(os.WTERMSIG(status))
            if sig == "SIGXCPU":  # RLIMIT_CPU and the wall clock race for a spinning program: both are a timeout
                return {"ok": False, "error": "timeout: exceeded the cpu time limit"}
            return {"ok": False, "error": f"process died: killed by {sig}"}
        if frame:
            return {"ok": False, "error": "malformed or forged reply frame", "forged": True}
        return {"ok": False, "error": f"process exited without a reply (status {status})"}
    if keep_stdout and reply["ok"]:
        reply["stdout"] = bufs[cap].decode("utf-8", "replace")
    return reply


def _serve_pair(prog, check, req):
    """Relay an assertion test: the checker's queries to the program, each answer back, until the checker's
    final frame. The program speaks only when asked; the zygote parses none of its frames."""
    limit = int(req["max_output_bytes"])
    deadline = time.monotonic() + float(req["timeout_s"])
    for fd in (prog.req_w, check.req_w):
        os.set_blocking(fd, False)
    inbox = {check.result_r: b"", prog.result_r: b""}
    outbox = {prog.req_w: b"", check.req_w: b""}
    readers = {check.result_r, prog.result_r, prog.cap_r, check.cap_r}
    asked, final, why = False, None, None
    while final is None and why is None:
        left = deadline - time.monotonic()
        if left <= 0:
            why = f"timeout: exceeded {req['timeout_s']}s wall clock"
            break
        readable, writable, _ = select.select(list(readers), [fd for fd, out in outbox.items() if out], [], left)
        for fd in writable:
            try:
                outbox[fd] = outbox[fd][os.write(fd, outbox[fd]):]
            except BlockingIOError:
                pass
            except OSError:
                why = "the program's process ended during the tests"
        for fd in readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                readers.discard(fd)
                if fd in inbox:
                    why = why or ("the program's process ended during the tests" if fd == prog.result_r
                                  else "the test process ended without a result")
                continue
            if fd not in inbox:
                continue  # stdout of either process: drained and dropped
            inbox[fd] += chunk
            if len(inbox[fd]) > limit + 4:
                why = f"output limit: more than {limit} bytes"
                break
            while why is None and final is None and _frame_complete(inbox[fd]):
                n = 4 + struct.unpack(">I", inbox[fd][:4])[0]
                frame, inbox[fd] = inbox[fd][:n], inbox[fd][n:]
                if fd == prog.result_r:
                    if not asked:
                        why = "the program wrote a frame nobody asked for"
                        break
                    outbox[check.req_w] += frame
                    asked = False
                    continue
                try:
                    msg = json.loads(frame[4:].decode())
                except (ValueError, RecursionError):
                    msg = None
                if isinstance(msg, dict) and set(msg) == {"q"} and not asked:
                    query = json.dumps(msg["q"]).encode()
                    outbox[prog.req_w] += struct.pack(">I", len(query)) + query
                    asked = True
                else:
                    final = frame[4:]
    _finish([prog, check])
    if why is not None:
        return {"ok": False, "error": why, "forged": why.startswith("the program wrote")}
    reply = _validate(final, req["nonce"], "program")
    return reply if reply is not None else {"ok": False, "error": "malformed result of the test process"}


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


def _read_request(inp):
    """frame: 4-byte length + header JSON (nonce, kind, mode, limits, parts), then ``parts`` payloads, each
    4-byte length + JSON (the code and its inputs; only a child parses it). None at end of file."""
    hdr = rpc.read_exact(inp, 4)
    header = None if hdr is None else rpc.read_exact(inp, struct.unpack(">I", hdr)[0])
    if header is None:
        return None, None
    req = json.loads(header.decode())
    payloads = []
    for _ in range(int(req.get("parts", 1))):
        size = rpc.read_exact(inp, 4)
        payload = None if size is None else _read_into(inp, struct.unpack(">I", size)[0])
        if payload is None:
            return None, None
        payloads.append(payload)
    return req, payloads


def _serve(req, payloads, current, forker):
    """One call: hand each payload to a spare of ``current``, ask for the next call's spare, collect the reply.
    Failures before the hand-over are ``sandbox_failure``; anything after it is the call's own failure."""
    pair = len(current) == 2
    why = None
    for spare, payload in zip(current, payloads):
        why = why or _hand_over(spare, payload, keep_open=pair)
    for _ in current:  # the next calls' spares fork and jail themselves while this call runs
        forker.request()
    if why is not None:
        _finish(current)
        return {"ok": False, "error": why, "sandbox_failure": True}
    try:
        return _serve_pair(*current, req) if pair else _serve_one(current[0], req, forker)
    except Exception as e:  # noqa: BLE001 - after the hand-over: the call's failure, its processes killed
        _finish(current)
        return {"ok": False, "error": f"the call failed in the zygote: {_err(e)}"}


def main():
    cfg = json.loads(sys.argv[1])
    inp, out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)  # stray prints from this process can never reach the protocol channel
    os.close(devnull)
    jail = _Jail(cfg)
    forker = _Forker(jail, (inp, out))
    hello = json.dumps({"ready": True, "pid": os.getpid(), "seccomp": jail.filter is not None}).encode()
    os.write(out, struct.pack(">I", len(hello)) + hello)
    for _ in range(2):  # two ready spares: an assertion test takes both (the program's and the checker's)
        forker.request()
    spares = []
    while True:
        req, payloads = _read_request(inp)
        if req is None:
            for spare in spares:
                spare.discard()
            return
        try:
            while len(spares) < len(payloads):
                spares.append(forker.receive())
            current, spares = spares[:len(payloads)], spares[len(payloads):]
            reply = _serve(req, payloads, current, forker)
        except OSError as e:  # the fork server is gone: report, and exit so that the parent starts afresh
            reply, payloads = {"ok": False, "error": f"sandbox: {_err(e)}", "sandbox_failure": True}, None
        reply["nonce"] = req["nonce"]
        data = json.dumps(reply).encode()
        data = struct.pack(">I", len(data)) + data
        while data:
            data = data[os.write(out, data):]
        if payloads is None:
            return
        forker.drain()


if __name__ == "__main__":
    main()
