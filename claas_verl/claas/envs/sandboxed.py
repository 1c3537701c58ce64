"""A CLaaS verifier whose grader code runs in the OS sandbox (:mod:`claas_verl.sandbox`)."""

from __future__ import annotations

from dataclasses import dataclass

from claas_verl.claas.envs.base import Verdict
from claas_verl.sandbox import DEFAULT_LIMITS, SandboxLimits, shared_pool


@dataclass(frozen=True)
class SandboxedVerifier:
    """A :class:`~claas_verl.claas.envs.base.Verifier` running grader ``source`` in the process-wide sandbox pool.

    Holds only plain data (picklable); the pool is looked up per process. ``fail_feedback``
    is the feedback text on a failed step (the graders return a bare bool).
    """

    source: str
    fail_feedback: str | None = None
    limits: SandboxLimits = DEFAULT_LIMITS
    n_workers: int = 1

    def __call__(self, visible_text: str, user_context: str) -> Verdict:
        passed = shared_pool(self.limits, self.n_workers).run(self.source, visible_text, user_context)
        return Verdict(passed=True) if passed else Verdict(passed=False, feedback=self.fail_feedback)
