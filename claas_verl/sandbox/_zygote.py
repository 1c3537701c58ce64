"""Sandbox zygote: a clean stdlib-only interpreter that forks jailed children for the calls.

Started by :mod:`claas_verl.sandbox.grader_sandbox` as ``python -I -S <this file> <config json>``, normally under
``unshare --net --pid --ipc --fork --mount --mount-proc`` so that this process is PID 1 of a fresh PID
namespace, in a network namespace with no usable interface (only ``lo``, down) and a private mount
namespace. It never runs untrusted code itself.

Clean spares. Before it reads any request the zygote forks a *fork server*, which never holds anything of a
call; every jailed child is forked from it (:mod:`_fork_server`), so no child can find an earlier call's code,
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
6. sets ``no_new_privs`` and loads a seccomp *allow-list* (:mod:`_seccomp_filter`: memory, reading its own
   descriptors, read-only opens, clocks, signals to itself, exit); every other system call fails
   (ENOSYS, or EPERM for the familiar escapes in its ``_DENY_EPERM``), including ``prctl``, so the
   parent-death signal cannot be cleared,
7. reads its request, runs the code and writes *one* JSON reply that carries the call's nonce to fd 3,
   then ``_exit``\\ s. A grader's stdout is drained and dropped; a program's (IO tests) is returned.

Assertion tests take two spares: the program's process answers queries and the checker's process runs the
assertions (:mod:`_jail_rpc`); the zygote relays their frames.

The zygote reads at most ``max_output_bytes`` from the result and capture pipes, kills the child's process
group at the wall-clock limit (also when the child closed its pipes and lingers) or when the output limit is
crossed, and answers the parent with a reply that echoes the request nonce. Child replies are validated
(JSON object, the call's nonce, typed fields); anything else is reported as an error of that call. Once a
request is handed over, whatever happens is that call's code's failure, never a sandbox failure; only a
failure before the hand-over (a spare that could not jail itself) is ``sandbox_failure``.

Protocol with the parent on fd 0/1: a request is a length-prefixed (4-byte big-endian) JSON header (nonce,
kind, mode, limits, ``parts``) and ``parts`` length-prefixed payloads (code and inputs, JSON; one per jailed
process) that only the children parse. A reply is one length-prefixed JSON object.
The zygote imports only the standard library (and libseccomp through the pyseccomp file given in the config):
it runs outside the venv, and ``-I`` keeps this directory off ``sys.path``. Its parts are loaded by path, in
dependency order, and registered under their bare names (:data:`_PARTS`), so that they import each other
without a search path: :mod:`_jail_rpc` (assertion tests), :mod:`_seccomp_filter` (the allow-list),
:mod:`_jail` (the jail set-up), :mod:`_jail_child` (what a spare runs), :mod:`_fork_server` (spares),
:mod:`_relay` (one call). Their names start with ``_``, so assertion snippets never see them as modules.
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
import ctypes  # noqa: F401
import dataclasses  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import difflib  # noqa: F401
import enum  # noqa: F401
import errno  # noqa: F401
import fcntl  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import gc  # noqa: F401
import hashlib  # noqa: F401
import heapq  # noqa: F401
import html  # noqa: F401
import importlib.util
import inspect  # noqa: F401
import io  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import numbers  # noqa: F401
import operator  # noqa: F401
import os
import random  # noqa: F401
import re  # noqa: F401
import resource  # noqa: F401
import select  # noqa: F401
import signal  # noqa: F401
import socket  # noqa: F401 - preloaded so that attacks meet the OS barriers, not a missing module
import statistics  # noqa: F401
import string  # noqa: F401
import struct
import subprocess  # noqa: F401 - see socket
import sys
import textwrap  # noqa: F401
import time  # noqa: F401
import traceback  # noqa: F401
import types  # noqa: F401
import typing  # noqa: F401
import unicodedata  # noqa: F401

unicodedata.normalize("NFKC", "x")  # load the unicode database now, not in the jail

_HERE = os.path.dirname(os.path.abspath(__file__))
_PARTS = ("_jail_rpc", "_seccomp_filter", "_jail", "_jail_child", "_fork_server", "_relay")


def _load_part(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


for _name in _PARTS:
    _load_part(_name)

import _jail_rpc as rpc  # noqa: E402 - loaded by path just above
from _fork_server import _Forker  # noqa: E402
from _jail import _Jail  # noqa: E402
from _jail_rpc import _err  # noqa: E402
from _relay import _serve  # noqa: E402


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
