"""Per-call limits and the isolation policy: what the machine allows, and the refusal when it is too weak."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache

_UNSHARE_ROOT = ("--net", "--pid", "--ipc", "--fork", "--mount", "--mount-proc", "--kill-child")
_UNSHARE_USER = ("--user", "--map-root-user", *_UNSHARE_ROOT)


class SandboxUnavailable(RuntimeError):
    """The kernel or the environment cannot give the isolation untrusted code needs, and no opt-in was set."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits and the isolation policy.

    ``timeout_s``: wall clock per jailed process; ``cpu_s``: RLIMIT_CPU; ``memory_mb``: RLIMIT_AS;
    ``max_output_bytes``: result frame / captured stdout; ``allow_weak_isolation``: run even where
    namespaces or seccomp are unavailable (logged as a warning), instead of refusing.
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20
    allow_weak_isolation: bool = False

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"SandboxLimits.timeout_s must be > 0, got {self.timeout_s!r}")
        if not (isinstance(self.cpu_s, int) and self.cpu_s >= 1):
            raise ValueError(f"SandboxLimits.cpu_s must be an int >= 1, got {self.cpu_s!r}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise ValueError(
                f"SandboxLimits.memory_mb must be an int >= 64 (the interpreter needs it), got {self.memory_mb!r}"
            )
        if not (isinstance(self.max_output_bytes, int) and self.max_output_bytes >= 4096):
            raise ValueError(f"SandboxLimits.max_output_bytes must be an int >= 4096, got {self.max_output_bytes!r}")
        if not isinstance(self.allow_weak_isolation, bool):
            raise ValueError(f"SandboxLimits.allow_weak_isolation must be a bool, got {self.allow_weak_isolation!r}")


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class IsolationSupport:
    """What this machine allows. ``unshare_args``: the namespace flags that worked (empty: none)."""

    unshare_args: tuple[str, ...]
    seccomp_path: str | None
    root: bool
    detail: str = ""

    @property
    def namespaces(self) -> bool:
        return bool(self.unshare_args)

    @property
    def strong(self) -> bool:
        return self.namespaces and self.seccomp_path is not None

    def missing(self) -> list[str]:
        out = []
        if not self.namespaces:
            out.append(f"network/PID/mount namespaces ({self.detail or 'unshare refused'})")
        if self.seccomp_path is None:
            out.append("seccomp (pip install pyseccomp; needs libseccomp.so.2)")
        return out


def _find_seccomp() -> str | None:
    try:
        import pyseccomp
    except Exception:  # noqa: BLE001 - missing module or missing libseccomp.so: no seccomp
        return None
    return os.path.abspath(pyseccomp.__file__)


@lru_cache(maxsize=1)
def probe_isolation() -> IsolationSupport:
    """Try the namespaces once per process (``unshare ... true``); find pyseccomp. Never raises."""
    root = os.geteuid() == 0
    seccomp = _find_seccomp()
    unshare = shutil.which("unshare")
    if unshare is None:
        return IsolationSupport((), seccomp, root, "no unshare binary (util-linux)")
    detail = ""
    for args in ((_UNSHARE_ROOT, _UNSHARE_USER) if root else (_UNSHARE_USER,)):
        try:
            r = subprocess.run([unshare, *args, "true"], capture_output=True, timeout=30, env=_clean_env())
        except (OSError, subprocess.SubprocessError) as e:
            detail = f"{type(e).__name__}: {e}"
            continue
        if r.returncode == 0:
            return IsolationSupport((unshare, *args), seccomp, root)
        detail = r.stderr.decode(errors="replace").strip()[:300]
    return IsolationSupport((), seccomp, root, detail)


def require_isolation(limits: SandboxLimits = DEFAULT_LIMITS,
                      isolation: IsolationSupport | None = None) -> IsolationSupport:
    """The machine's isolation support; :class:`SandboxUnavailable` when it is weak and ``limits`` did not opt in."""
    iso = isolation if isolation is not None else probe_isolation()
    if not iso.strong and not limits.allow_weak_isolation:
        raise SandboxUnavailable(
            "refusing to run untrusted code: this machine lacks " + "; ".join(iso.missing())
            + ". Fix the machine (run as root or allow unprivileged user namespaces; install pyseccomp), or "
            "accept weaker isolation explicitly with SandboxLimits(allow_weak_isolation=True) "
            "(recipe: +claas.env.kwargs.sandbox.allow_weak_isolation=true)."
        )
    return iso


def _clean_env() -> dict[str, str]:
    # Nothing from the parent environment (API keys, tokens, proxies) reaches the zygote.
    return {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
