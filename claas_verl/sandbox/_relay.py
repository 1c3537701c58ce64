"""One call in the zygote: hand the request to its ready spares, relay and bound their output, validate the
child's frame into the reply (one process for graders, IO and call tests; two for assertion tests).

Part of the zygote: loaded by path by :mod:`_zygote`, never imported from the venv.
"""

import json
import os
import select
import signal
import struct
import time

from _fork_server import _close_pipes, _kill_group
from _jail_rpc import _MAX_ERROR_CHARS, _err

_READY_TIMEOUT_S = 10.0  # grader_sandbox._PARENT_MARGIN_S leaves room for it


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
