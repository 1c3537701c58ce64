"""OS-level sandbox for untrusted code: IH-Challenge graders and model-written programs.

Two kinds of untrusted code run here, never in the trainer's process: per-scenario graders
(``grade_output_correct``, docs/math.md §A.1.4) and the code domain's programs run against test cases.

What a call gets (see :mod:`claas_verl.sandbox._zygote` for the mechanics)
-------------------------------------------------------------------------------
Each :class:`GraderSandbox` starts one *zygote* (``python -I -S``: no site-packages, empty environment) under
``unshare --net --pid --ipc --fork --mount --mount-proc`` (as root; ``--user --map-root-user`` is added otherwise),
which keeps one spare child forked and jailed ahead of each call (forked while the previous call runs) by a
fork server that never held anything of a call. The child, before it reads anything of the call:

- lives in a network namespace with no usable interface and a PID namespace where it sees no other process;
- ``chroot``\\ s into an empty read-only directory: no file of the host (no ``/proc/<pid>/environ``, no
  ``/etc``, no ``/dev``) is visible, and only the modules the zygote preloaded can be imported;
- runs as ``nobody`` (uid/gid 65534) when the trainer runs as root, or without any capability as root of an
  unprivileged user namespace, with ``no_new_privs``;
- has a seccomp *allow-list* (libseccomp through ``pyseccomp``, ``_seccomp_filter._ALLOW``): memory, reads of
  its own descriptors, read-only opens, clocks, signals to itself, exit. Everything else fails (fork/clone/
  exec, sockets, write-opens, ptrace, signals to other processes, ``prctl``, the new mount API, and whatever
  a later kernel adds), so a call cannot touch the spare that waits to serve the next one, nor clear its
  parent-death signal;
- holds exactly four descriptors: ``/dev/null`` on 0 and 2, a stdout pipe on 1 (dropped for graders,
  compared for programs) and a result pipe created for this call on 3;
- has rlimits on CPU seconds, address space, file size (0), processes (0), descriptors and core dumps;
- is killed with its whole process group at the wall-clock limit, or when its output exceeds
  ``max_output_bytes``.

Verdicts cannot be forged across calls or shifted: every call has its own result pipe and a random nonce, the
zygote accepts one length-prefixed JSON frame carrying that nonce, and the parent accepts only a zygote reply
echoing the request nonce. A trusted-side failure (a dead or hung zygote, a bad zygote frame, a nonce
mismatch, a jail that could not be set up) is a *sandbox failure*: the call raises :class:`GraderError`
(reward None, docs/math.md §A.1.4), ``stats.sandbox_failures`` counts it, and the zygote is recycled so the next call
starts clean. A malformed or foreign frame written by the code itself is that code's failure
(``stats.forged_frames``): reward None for a grader, 0.0 for a program, so a program cannot turn a wrong
answer into a dropped sample. Whatever a call's code does once it was handed over (a real-time signal, a
crash, closing its pipes and sleeping) is that code's failure, bounded by the call's own wall clock; only a
jail that could not be set up is a sandbox failure. :meth:`GraderSandbox.run` raises nothing but
:class:`GraderError` once the sandbox is up. A call's process is forked from the fork server, whose memory
never held a request or a reply: no call can read another call's code, inputs, verdict or output.
:meth:`GraderSandbox.close` kills every process a call started (the zygote's namespace, or the parent-death
signal the jail cannot clear).

Where the kernel refuses namespaces, or ``pyseccomp``/libseccomp is missing, a sandbox refuses to start
(:class:`SandboxUnavailable`) unless ``SandboxLimits(allow_weak_isolation=True)`` (recipe:
``+claas.env.kwargs.sandbox.allow_weak_isolation=true``) opts in; it then runs with what is left (chroot, uid drop,
seccomp, rlimits, as available) and logs a warning at every zygote start.

Graders
-------
``GraderSandbox.run(source, output, context) -> bool``: ``source`` defines ``grade_output_correct(output)``
or ``(output, user_context)`` returning a bool. Any failure (exception, timeout, CPU/memory/output limit,
non-bool, blocked syscall, sandbox failure) raises :class:`GraderError`.
:class:`GraderPool` holds ``n_workers`` sandboxes (``run`` from many threads, or ``map`` to grade a batch in
parallel); :class:`~claas_verl.claas.envs.sandboxed.SandboxedVerifier` is the picklable CLaaS scenario verifier using
the process-wide pool.

Programs (the code domain)
--------------------------
``run_program(source, tests, timeout_s=5.0, *, limits=None, pool=None) -> ProgramResult``

``tests`` is a sequence of

- :class:`IOTest` ``(stdin, expected_stdout)``: the program runs as ``__main__`` with ``stdin`` on
  ``sys.stdin``; the zygote captures its stdout and the *parent* compares it with ``expected_stdout``
  (trailing white space of lines and trailing blank lines ignored). One jailed process per test.
- :class:`CallTest` ``(fn, args, expected, atol=0.0)``: the program's module is executed (``__name__`` is
  ``"solution"``), then ``fn(*args)`` is called; the return value goes back as JSON and the parent compares
  it with ``expected`` (after the same JSON round trip: tuples compare equal to lists; floats within
  ``atol``). The expected values never enter the jail, so a program cannot read them.
- ``str``: an assertion snippet (MBPP's ``assert f(1) == 2``, loops, ``try``/``except`` included). It runs
  in a second jailed process, never in the program's: names that are neither builtins nor preloaded
  modules are looked up in the program, whose functions and objects the snippet calls remotely; values
  come back as plain data (None, bool, numbers, str, bytes, tuple, list, dict, set; subclasses as their
  base type), so every comparison runs on built-in values the program cannot override, and the expected
  values never enter the program's process. An object that is not plain data can be called, indexed or
  iterated but not compared or truth-tested (the test fails, naming why). A program's function that
  shadows a builtin or a module name is not reachable from a snippet.

All call tests of one ``run_program`` share one jailed process and the ``timeout_s`` budget, and so do all
assertion tests (with their checker process); each IO test has its own.
``GraderPool(n).run_programs([(source, tests), ...])`` runs many programs n at a time (evaluation sets).
:class:`ProgramResult` has ``status`` (``passed``, ``failed``, ``timeout``, ``sandbox_error``), ``passed`` /
``total`` test counts, per-test ``details`` and ``reward``: 1.0 when every test passed, 0.0 otherwise, None on
a sandbox failure (docs/math.md §A.1.4: never trained on).
A program that crashes, times out or prints too much fails its tests (reward 0.0): that is the model's fault.

Throughput: ``python benchmarks/bench_sandbox.py`` prints graders/s per pool size and the per-call overhead.

Layout: :mod:`.isolation` (limits, what the machine allows), :mod:`.grader_sandbox` (one zygote and its
protocol), :mod:`.pool` (pools, :func:`run_program`), :mod:`.programs` (test types
and their checks). The zygote's own files start with ``_`` and import only the standard library.
"""

from claas_verl.sandbox.errors import GraderError
from claas_verl.sandbox.grader_sandbox import GraderSandbox, SandboxStats
from claas_verl.sandbox.isolation import (
    DEFAULT_LIMITS,
    IsolationSupport,
    SandboxLimits,
    SandboxUnavailable,
    probe_isolation,
    require_isolation,
)
from claas_verl.sandbox.pool import GraderPool, run_program, shared_pool
from claas_verl.sandbox.programs import CallTest, IOTest, ProgramResult

__all__ = [
    "DEFAULT_LIMITS", "GraderError", "CallTest", "GraderPool", "GraderSandbox", "IOTest", "IsolationSupport",
    "ProgramResult",
    "SandboxLimits", "SandboxStats", "SandboxUnavailable", "probe_isolation",
    "require_isolation", "run_program", "shared_pool",
]
