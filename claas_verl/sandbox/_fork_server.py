"""The fork server and the spares it forks: no call's code, inputs or replies ever were in its memory.

Part of the zygote: loaded by path by :mod:`_zygote`, never imported from the venv.
"""

import os
import select
import signal
import socket
import struct
import time

from _jail import _PR_SET_PDEATHSIG
from _jail_child import _child


def _kill_group(pid):
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _close_pipes(spare):
    for name in ("req_w", "result_r", "cap_r"):
        fd = getattr(spare, name)
        if fd >= 0:
            os.close(fd)
            setattr(spare, name, -1)


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
