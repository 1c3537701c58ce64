"""The jailed child: jail itself, report ready, read its one request, run the grader or the program, answer.

Part of the zygote: loaded by path by :mod:`_zygote`, never imported from the venv. The code it runs sees
the real :mod:`builtins` module as ``__builtins__``, as it would in ``__main__``.
"""

import builtins
import inspect
import io
import json
import os
import struct
import sys

import _jail_rpc as rpc
from _jail import _REQUEST_FD, _RESULT_FD
from _jail_rpc import _MAX_ERROR_CHARS, _err


def _call_grader(fn, output, context):
    try:
        params = list(inspect.signature(fn).parameters.values())
        two = (len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2
               or any(p.kind == p.VAR_POSITIONAL for p in params))
    except (TypeError, ValueError):
        two = False
    return fn(output, context) if two else fn(output)


def _run_grader(req):
    ns = {"__name__": "ih_grader", "__builtins__": builtins}
    exec(compile(req["source"], "<grader>", "exec"), ns)
    fn = ns.get("grade_output_correct")
    if not callable(fn):
        return {"ok": False, "error": "grader source defines no callable grade_output_correct"}
    value = _call_grader(fn, req["output"], req["context"])
    if type(value) is not bool:
        return {"ok": False, "error": f"grade_output_correct returned {type(value).__name__}, expected bool"}
    return {"ok": True, "value": value}


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
        ns = {"__name__": "__main__", "__builtins__": builtins}
        try:
            exec(compile(req["source"], "<program>", "exec"), ns)
        except SystemExit as e:
            if e.code not in (None, 0):
                return {"ok": False, "error": f"SystemExit: {e.code!r}"[:_MAX_ERROR_CHARS]}
        finally:
            sys.stdout.flush()
        return {"ok": True}
    ns = {"__name__": "solution", "__builtins__": builtins}
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
