"""The jail's seccomp allow-list, compiled once to BPF with a placeholder for the spare's pid.

Part of the zygote (standard library and libseccomp through the pyseccomp file given in the config only):
loaded by path by :mod:`_zygote`, never imported from the venv.
"""

import ctypes
import errno
import fcntl
import importlib.util
import os
import struct

_PID_PLACEHOLDER = 0x5EC0FFEE  # stands for the spare's pid in the compiled filter (pids stay below 2**22)

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
