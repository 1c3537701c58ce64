"""What every jailed child applies to itself after fork: session, descriptors, chroot, uid or capabilities,
parent-death signal, rlimits, ``no_new_privs`` and the seccomp filter (steps 1-6 of :mod:`_zygote`).

Part of the zygote: loaded by path by :mod:`_zygote`, never imported from the venv.
"""

import ctypes
import fcntl
import os
import resource
import signal
import struct

from _seccomp_filter import _compile_filter, _load_seccomp, _SockFprog

NOBODY = 65534
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_RESULT_FD = 3
_REQUEST_FD = 4


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
