"""Grader zygote: a clean stdlib-only interpreter that forks one sandboxed child per grading call.

Started by :mod:`claas_verl.envs.sandbox` as ``python -I -S <this file>`` with an
empty environment (no inherited secrets), in a private temp directory. It never
runs grader code itself: each request forks a child that

1. points stdin/stdout/stderr at /dev/null (a grader's prints cannot corrupt the protocol),
2. sets rlimits: CPU seconds, address space, no file writes (FSIZE 0), no new
   processes (NPROC 0), no core dumps,
3. blocks the network twice: ``socket.socket``/``create_connection``/… replaced by
   a function that raises, and an audit hook (irremovable) that rejects every
   ``socket.*``, process-spawning, ``ctypes`` and file-writing event,
4. execs the grader source in a fresh namespace and calls ``grade_output_correct``
   with the visible output (plus the user context if it takes two positional
   parameters), and sends ``{"ok": true, "value": bool}`` or an error back.

The zygote kills the child at the wall-clock limit. A fresh fork per call keeps
graders from leaking state (monkeypatches, globals) into each other at ~ms cost.
Protocol on stdin/stdout: 4-byte big-endian length + UTF-8 JSON, one reply per request.
This file imports only the standard library: it runs outside the venv.
"""

# The modules marked F401 are preloaded: a grader importing them hits sys.modules (no file access, no cost per call).
import collections  # noqa: F401
import datetime  # noqa: F401
import difflib  # noqa: F401
import functools  # noqa: F401
import inspect
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import re  # noqa: F401
import resource
import select
import signal
import socket
import string  # noqa: F401
import struct
import sys
import textwrap  # noqa: F401
import time
import unicodedata  # noqa: F401

_BLOCKED_EVENT_PREFIXES = (
    "socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "ctypes.", "os.remove", "os.rename", "os.rmdir", "os.unlink", "os.truncate",
    "shutil.", "pty.", "webbrowser.", "urllib.", "http.", "ftplib.", "smtplib.", "telnetlib.",
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit(event, args):
    if event.startswith(_BLOCKED_EVENT_PREFIXES):
        raise PermissionError(f"sandbox: '{event}' is not allowed in a grader")
    if event == "open":
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 else 0
        writes_by_mode = isinstance(mode, str) and any(c in mode for c in "wax+")
        if writes_by_mode or (isinstance(flags, int) and flags & _WRITE_FLAGS):
            raise PermissionError("sandbox: opening files for writing is not allowed in a grader")


def _no_network(*_args, **_kwargs):
    raise PermissionError("sandbox: network access is not allowed in a grader")


def _seal(cpu_s, memory_mb):
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    except (ValueError, OSError):
        pass  # some kernels refuse lowering NPROC for root; the audit hook still blocks fork/spawn
    for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, _no_network)
    # `import _socket` directly would bypass the patch above, but not the audit hook: _socket raises socket.__new__
    sys.addaudithook(_audit)


def _grade(req):
    _seal(int(req["cpu_s"]), int(req["memory_mb"]))
    ns = {"__name__": "ih_grader", "__builtins__": __builtins__}
    exec(compile(req["source"], "<grader>", "exec"), ns)
    fn = ns.get("grade_output_correct")
    if not callable(fn):
        return {"ok": False, "error": "grader source defines no callable grade_output_correct"}
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        two = len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        two = False
    value = fn(req["output"], req["context"]) if two else fn(req["output"])
    if type(value) is not bool:
        return {"ok": False, "error": f"grade_output_correct returned {type(value).__name__}, expected bool"}
    return {"ok": True, "value": value}


def _child(req, w):
    try:
        reply = _grade(req)
    except BaseException as e:  # noqa: BLE001 - any grader failure is a reported error, never a crash of the pool
        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    data = json.dumps(reply).encode()
    while data:
        data = data[os.write(w, data):]
    os._exit(0)


def _serve_one(req):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(req, w)
    os.close(w)
    deadline = time.monotonic() + float(req["timeout_s"])
    buf, timed_out = b"", False
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            timed_out = True
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        buf += chunk
    os.close(r)
    if timed_out:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"ok": False, "error": f"timeout: grader exceeded {req['timeout_s']}s wall clock"}
    try:
        return json.loads(buf.decode())
    except ValueError:
        if os.WIFSIGNALED(status):
            sig = signal.Signals(os.WTERMSIG(status)).name
            why = "cpu time limit" if sig == "SIGXCPU" else f"killed by {sig}"
            return {"ok": False, "error": f"grader process died: {why}"}
        return {"ok": False, "error": f"grader process died without a reply (status {status})"}


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main():
    inp, out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # stray prints from this process can never reach the protocol channel
    while True:
        hdr = _read_exact(inp, 4)
        if hdr is None:
            return
        body = _read_exact(inp, struct.unpack(">I", hdr)[0])
        if body is None:
            return
        reply = json.dumps(_serve_one(json.loads(body.decode()))).encode()
        data = struct.pack(">I", len(reply)) + reply
        while data:
            data = data[os.write(out, data):]


if __name__ == "__main__":
    main()
