"""One sandbox: the zygote process, its lifecycle, and the framed, nonce-checked protocol with it."""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from claas_verl.sandbox.errors import GraderError
from claas_verl.sandbox.isolation import (
    DEFAULT_LIMITS,
    IsolationSupport,
    SandboxLimits,
    _clean_env,
    require_isolation,
)
from claas_verl.sandbox.programs import ProgramResult, _run_program_on

logger = logging.getLogger(__name__)

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote.py")
# wall time granted to the zygote beyond the call's own limit before it is presumed hung: up to
# _relay._READY_TIMEOUT_S (10 s) waiting for a spare that is still jailing itself, plus reaping
_PARENT_MARGIN_S = 15.0
_START_TIMEOUT_S = 60.0


@dataclass
class SandboxStats:
    """Counters of one sandbox (or a pool's sum). ``sandbox_failures``: protocol/setup failures (reward None)."""

    calls: int = 0
    code_errors: int = 0  # the untrusted code failed: exception, timeout, limit, non-bool, forged frame
    forged_frames: int = 0  # of which: the code wrote a malformed or foreign frame on its result pipe
    sandbox_failures: int = 0  # the trusted side failed: zygote/protocol/jail setup (reward None)
    restarts: int = 0

    def __add__(self, other: SandboxStats) -> SandboxStats:
        names = ("calls", "code_errors", "forged_frames", "sandbox_failures", "restarts")
        return SandboxStats(*(getattr(self, f) + getattr(other, f) for f in names))


class _SandboxFailure(Exception):
    pass


class GraderSandbox:
    """One zygote (one set of namespaces); calls are serialised. Use :class:`GraderPool` for parallelism.

    ``isolation``: what to assume the machine allows (default: :func:`probe_isolation`); tests pass a
    weaker :class:`IsolationSupport` to force the refusal and weak-isolation paths.
    """

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS, isolation: IsolationSupport | None = None):
        self.limits = limits
        self.isolation = require_isolation(limits, isolation)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._root: str | None = None
        self._started_once = False
        self.stats = SandboxStats()

    @property
    def restarts(self) -> int:
        return self.stats.restarts

    # -- zygote lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        iso = self.isolation
        if not iso.strong:
            logger.warning(
                "GRADER SANDBOX RUNS WITH WEAK ISOLATION (allow_weak_isolation=True): missing %s. Untrusted "
                "graders/programs may reach the network, other processes or files.", "; ".join(iso.missing()))
        can_chroot = iso.root or iso.namespaces  # CAP_SYS_CHROOT: real root, or root of the new user namespace
        self._root = tempfile.mkdtemp(prefix="claas_jail_") if can_chroot else None
        if self._root is not None:
            os.chmod(self._root, 0o555)
        cfg = {"root": self._root, "drop_uid": iso.root, "pyseccomp": iso.seccomp_path,
               "cpu_s": self.limits.cpu_s, "memory_mb": self.limits.memory_mb}
        cmd = [*iso.unshare_args, sys.executable, "-I", "-S", _WORKER, json.dumps(cfg)]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=_clean_env(), cwd=self._root or "/", close_fds=True, start_new_session=True,
        )
        if self._started_once:
            self.stats.restarts += 1
        self._started_once = True
        hello = self._read_frame(time.monotonic() + _START_TIMEOUT_S)
        if not hello.get("ready"):
            raise _SandboxFailure(f"zygote did not start: {hello}")
        if iso.seccomp_path is not None and not hello.get("seccomp"):
            raise _SandboxFailure("zygote could not build the seccomp filter")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, 9)  # the unshare process, the zygote (PID 1 of its namespace) and children
            except (ProcessLookupError, PermissionError):
                pass
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                f.close()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd, buf = self._proc.stdout.fileno(), b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _SandboxFailure("zygote did not answer in time")
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise _SandboxFailure("zygote exited")
            buf += chunk
        return buf

    def _read_frame(self, deadline: float) -> dict:
        n = struct.unpack(">I", self._read_exact(4, deadline))[0]
        if n > 8 * self.limits.max_output_bytes + (1 << 16):  # JSON escaping grows text up to 6x
            raise _SandboxFailure(f"zygote frame of {n} bytes exceeds the output limit")
        reply = json.loads(self._read_exact(n, deadline).decode())
        if not isinstance(reply, dict):
            raise _SandboxFailure("zygote frame is not an object")
        return reply

    def _call(self, req: dict[str, Any]) -> dict:
        """One request -> the zygote's validated reply. Raises only :class:`GraderError` (sandbox failures counted)."""
        nonce = secrets.token_hex(16)
        lim = self.limits
        if req.get("mode") == "assert":  # the program and the assertions in two processes (_jail_rpc)
            parts = [{"kind": "program", "mode": "serve", "source": req["source"]},
                     {"kind": "program", "mode": "check", "tests": [t["code"] for t in req["tests"]], "nonce": nonce}]
        else:
            parts = [{**req, "nonce": nonce}]
        header = json.dumps({"nonce": nonce, "kind": req["kind"], "mode": req.get("mode"), "parts": len(parts),
                             "timeout_s": lim.timeout_s, "max_output_bytes": lim.max_output_bytes}).encode()
        frame = struct.pack(">I", len(header)) + header
        for part in parts:
            payload = json.dumps(part).encode()
            frame += struct.pack(">I", len(payload)) + payload
        with self._lock:
            self.stats.calls += 1
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._kill()
                    self._start()
                self._proc.stdin.write(frame)
                self._proc.stdin.flush()
                reply = self._read_frame(time.monotonic() + lim.timeout_s + _PARENT_MARGIN_S)
                if reply.get("nonce") != nonce:
                    raise _SandboxFailure("zygote reply carries another call's nonce")
                if not isinstance(reply.get("ok"), bool):
                    raise _SandboxFailure("zygote reply has no 'ok' flag")
            except Exception as e:  # noqa: BLE001 - any protocol error: recycle, reward None, never crash the run
                self._kill()
                self.stats.sandbox_failures += 1
                logger.warning("grader sandbox failure (zygote recycled): %s: %s", type(e).__name__, e)
                raise GraderError(f"grader sandbox failed: {type(e).__name__}: {e}") from e
            if not reply["ok"]:
                if reply.get("sandbox_failure"):
                    self.stats.sandbox_failures += 1
                else:
                    self.stats.code_errors += 1
                    self.stats.forged_frames += bool(reply.get("forged"))
            return reply

    # -- public ----------------------------------------------------------------------------------
    def run(self, source: str, output: str, context: str = "") -> bool:
        """Run ``grade_output_correct`` from ``source`` on ``output``; True/False, or raise :class:`GraderError`."""
        reply = self._call({"kind": "grade", "source": str(source), "output": str(output), "context": str(context)})
        if not reply["ok"]:
            raise GraderError(str(reply.get("error", "unknown grader error")))
        value = reply.get("value")
        if not isinstance(value, bool):
            with self._lock:
                self.stats.sandbox_failures += 1
            raise GraderError("grader sandbox returned a verdict that is not a bool")
        return value

    def run_program(self, source: str, tests: Sequence[Any]) -> ProgramResult:
        """Run ``source`` against ``tests`` (see the module docstring); never raises for a bad program."""
        return _run_program_on(self.run_raw_program, source, tests)

    def run_raw_program(self, req: dict[str, Any]) -> dict:
        return self._call({"kind": "program", **req})

    def start(self) -> None:
        """Start the zygote now (else on the first call); raises :class:`GraderError` if it cannot start."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                try:
                    self._kill()
                    self._start()
                except Exception as e:  # noqa: BLE001
                    self._kill()
                    self.stats.sandbox_failures += 1
                    raise GraderError(f"grader sandbox failed to start: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __enter__(self) -> GraderSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort only
            pass
