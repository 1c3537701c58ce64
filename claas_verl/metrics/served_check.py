"""Does the server serve what the trainer trained? The comparison of a probe scored on both sides, and its alarm.

After a weight push (MOPD's weight sync, a CLaaS adapter reload) a fixed probe is scored twice at the same tokens:
by the serving engine (``served_j``) and by the trainer's forward of the weights it just pushed (``trained_j``),
``j = 1..K`` over every probe (and replica). With ``d_j = |served_j - trained_j|``::

    max_abs  = max_j d_j          mean_abs = (1/K) sum_j d_j

The served weights are accepted when ``max_abs <= tolerance.max_abs`` and ``mean_abs <= tolerance.mean_abs``; a
non-finite value on either side is a mismatch. Kernel rounding alone gives about 1e-6 nat with fp32 on CPU; a bf16
rollout against an fp32 trainer 0.06-0.13 nat per token (docs/limits.md); an adapter that is not the trained one
(the base model, an older version, another tenant's) moves greedy-token log-probs by far more.

:class:`ServedCheckAlarm` counts mismatches, logs a line for each and raises :class:`ServedWeightsMismatch` once
``max_failures`` have happened: the caller keeps serving the previous weights until then (CLaaS) or stops at once
(``max_failures = 1``, MOPD). Pure Python: no torch, no Ray.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class ServedWeightsMismatch(RuntimeError):
    """The served weights disagreed with the trained ones beyond the tolerance ``max_failures`` times."""


@dataclass(frozen=True)
class ProbeTolerance:
    """Largest accepted per-token log-prob difference (``max_abs``) and mean difference (``mean_abs``), nats."""

    max_abs: float
    mean_abs: float

    def __post_init__(self):
        for name in ("max_abs", "mean_abs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"probe tolerance {name} must be a finite number > 0 (nats), got {value!r}")


@dataclass(frozen=True)
class ProbeVerdict:
    """The comparison: ``ok``, ``max_abs`` and ``mean_abs`` (nan when a value was not finite), ``tokens`` compared."""

    ok: bool
    max_abs: float
    mean_abs: float
    tokens: int

    def describe(self, tolerance: ProbeTolerance) -> str:
        return (f"max |served - trained| = {self.max_abs:.3g} nat (tolerance {tolerance.max_abs:g}), mean "
                f"{self.mean_abs:.3g} (tolerance {tolerance.mean_abs:g}) over {self.tokens} probe tokens")


def compare_probe(served: Sequence[Sequence[float]], trained: Sequence[Sequence[float]],
                  tolerance: ProbeTolerance) -> ProbeVerdict:
    """Compare per-token log-probs, ``served[r][j]`` against ``trained[r][j]`` (``r``: probe or replica)."""
    if len(served) != len(trained) or any(len(s) != len(t) for s, t in zip(served, trained)):
        raise ValueError(f"served and trained probe log-probs differ in shape: {[len(s) for s in served]} against "
                         f"{[len(t) for t in trained]}")
    diffs = [abs(float(s) - float(t)) for ss, tt in zip(served, trained) for s, t in zip(ss, tt)]
    if not diffs:
        raise ValueError("the probe has no tokens to compare")
    if not all(math.isfinite(d) for d in diffs):
        return ProbeVerdict(False, math.nan, math.nan, len(diffs))
    max_abs, mean_abs = max(diffs), sum(diffs) / len(diffs)
    return ProbeVerdict(max_abs <= tolerance.max_abs and mean_abs <= tolerance.mean_abs, max_abs, mean_abs,
                        len(diffs))


class ServedCheckAlarm:
    """Mismatch counter (per subject and in total) that stops the run after ``max_failures`` mismatches."""

    def __init__(self, tolerance: ProbeTolerance, max_failures: int, what: str):
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1:
            raise ValueError(f"{what}: max_failures must be an int >= 1 (1 stops at the first mismatch), "
                             f"got {max_failures!r}")
        self.tolerance, self.max_failures, self.what = tolerance, max_failures, what
        self.failures: dict[str, int] = {}
        self.checks = 0

    @property
    def total_failures(self) -> int:
        return sum(self.failures.values())

    def check(self, subject: str, served, trained) -> ProbeVerdict:
        """Compare, count and log; raise :class:`ServedWeightsMismatch` at the ``max_failures``-th mismatch."""
        verdict = compare_probe(served, trained, self.tolerance)
        self.checks += 1
        if verdict.ok:
            return verdict
        self.failures[subject] = self.failures.get(subject, 0) + 1
        logger.error("%s: served weights of %s do not match the trained ones: %s (mismatch %d of %d allowed)",
                     self.what, subject, verdict.describe(self.tolerance), self.total_failures, self.max_failures)
        if self.total_failures >= self.max_failures:
            raise ServedWeightsMismatch(
                f"{self.what}: the served weights of {subject} do not match the trained ones "
                f"({verdict.describe(self.tolerance)}); {self.total_failures} mismatch(es), the limit is "
                f"{self.max_failures}. The server is not serving what was trained: check the weight push (LoRA "
                "loading, adapter names, dtype of the serving engine), or raise the tolerance if the engine's "
                "rounding alone exceeds it")
        return verdict
