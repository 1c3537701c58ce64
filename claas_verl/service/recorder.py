"""Turn served responses into replay entries (SPEC A.1.1, A.1.4) and hold them until their reward arrives.

One assistant turn becomes one :class:`~claas_verl.replay.ReplayEntry` (entry unit ``"step"``, SPEC A.1.5):

* ``prompt_ids``: the full chat context as templated for the policy; ``response_ids``: the sampled tokens incl. EOS;
* ``behaviour_logprob = Σ_j log π_β(y_j | x, y_<j)`` summed over exactly ``response_ids`` (the tokens with m=1);
* ``P``: the policy version that served the request (captured when it started, SPEC A.1.1);
* ``uid``: the request id, so a retried write is idempotent in the buffer.

The reward comes from a grader (immediately) or from ``POST /v1/feedback``; until then the turn waits in a bounded
pending table. Reward ``None`` (grader error) drops the turn before it reaches the buffer (SPEC A.1.4); so do a
pending turn's timeout and the table's overflow (its oldest turn goes). Every outcome is counted.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from claas_verl.replay.entry import ReplayEntry
from claas_verl.service.backend import Generation

COUNTERS = (
    "served",  # responses returned to clients
    "not_recorded",  # the client opted out (metadata record=false / X-Claas-Record: 0) or recording is off
    "rejected_sampling",  # SPEC §0: not τ=1 / top_p=1 / top_k off
    "rejected_unrecordable",  # backend gave no prompt ids or per-token log-probs, no scenario id, ...
    "rejected_invalid",  # ReplayEntry validation refused the turn
    "pending",  # turns put in the pending table (cumulative)
    "graded",  # turns handed to the grader (cumulative)
    "submitted",  # entries handed to the sink
    "dropped_reward_none",  # reward None from a grader or from feedback (SPEC A.1.4)
    "dropped_grader_error",  # the grader raised
    "dropped_timeout",  # no feedback within pending_ttl_s
    "dropped_overflow",  # pending table full: its oldest turn was dropped
    "dropped_aborted",  # the generation was aborted/cut by the server (finish reason not stop/length)
    "dropped_disconnected",  # a streaming client went away before the final chunk (generation stopped or withdrawn)
    "dropped_stream_error",  # the backend failed after a stream started (the client got an error event)
    "feedback_unknown",  # feedback for an unknown / already finished / expired request id
)


@dataclass
class TurnRecord:
    """A served turn that may become an entry once it has a reward."""

    request_id: str
    scenario_id: int
    step_idx: int | None
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprob: float
    policy_version: int
    domain: str | None = None
    metadata: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)  # for the grader
    text: str = ""


def unrecordable_reason(gen: Generation) -> str | None:
    """Why ``gen`` cannot become an entry (missing ids/log-probs, length mismatch), or None."""
    if gen.prompt_ids is None:
        return "the backend returned no prompt token ids (give OpenAIBackend a tokenizer or use vLLM >= 0.10.2)"
    if not gen.response_ids:
        return "the response has no tokens"
    if gen.token_logprobs is None:
        return "the backend returned no per-token log-probs"
    if len(gen.token_logprobs) != len(gen.response_ids):
        return (f"the backend returned {len(gen.token_logprobs)} log-probs for {len(gen.response_ids)} response "
                "tokens; the behaviour log-prob must cover exactly the masked tokens")
    if not all(math.isfinite(x) for x in gen.token_logprobs):
        return "the backend returned a non-finite per-token log-prob"
    return None


def behaviour_logprob(token_logprobs: list[float]) -> float:
    """ℓ^b = Σ_j log π_β(y_j | ·) over every response token (SPEC A.1.1), summed exactly (``math.fsum``).

    Clamped at 0: each term is <= 0, so a positive sum is only bf16/fp16 rounding of many ~0 terms.
    """
    return min(math.fsum(token_logprobs), 0.0)


class TrajectoryRecorder:
    """Builds entries, holds turns awaiting feedback and hands entries to a sink (thread-safe).

    Args:
        sink: see :mod:`claas_verl.service.sinks` (``submit``, ``flush``, ``stats``).
        max_pending: bound of the pending table; a new turn beyond it drops the oldest one (counted).
        pending_ttl_s: a pending turn without feedback for this long is dropped (counted) at the next sweep.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, sink, *, max_pending: int = 4096, pending_ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if not pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s}")
        self.sink = sink
        self.max_pending = int(max_pending)
        self.pending_ttl_s = float(pending_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, tuple[TurnRecord, float]] = OrderedDict()
        self._counts: Counter = Counter()

    # ------------------------------------------------------------------ counting
    def count(self, name: str, n: int = 1) -> None:
        if name not in COUNTERS:
            raise ValueError(f"unknown counter {name!r}; one of {COUNTERS}")
        with self._lock:
            self._counts[name] += n

    def stats(self) -> dict:
        """Every counter, the current pending-table size, and the sink's counters under ``sink``."""
        self.sweep()
        with self._lock:
            out = {name: self._counts[name] for name in COUNTERS}
            out["pending_now"] = len(self._pending)
        out["sink"] = self.sink.stats()
        return out

    # ------------------------------------------------------------------ outcomes
    def finish(self, record: TurnRecord, reward: float | None, feedback: str | None) -> tuple[str, str | None]:
        """Turn ``record`` into an entry with ``reward`` and submit it; returns ``(status, reason)`` for the client.

        ``"submitted"``; ``"dropped"`` (reward None, SPEC A.1.4); ``"rejected"`` (the entry failed validation).
        """
        if reward is None:
            self.count("dropped_reward_none")
            return "dropped", "reward None (grader error): never used for training (SPEC A.1.4)"
        try:
            entry = ReplayEntry(
                uid=record.request_id,
                scenario_id=record.scenario_id,
                step_idx=record.step_idx,
                prompt_ids=record.prompt_ids,
                response_ids=record.response_ids,
                behaviour_logprob=record.behaviour_logprob,
                reward=reward,
                feedback=feedback,
                domain=record.domain,
                metadata=record.metadata,
                P=record.policy_version,
            )
        except ValueError as exc:
            self.count("rejected_invalid")
            return "rejected", f"invalid entry: {exc}"
        self.sink.submit([entry])
        self.count("submitted")
        return "submitted", None

    def hold(self, record: TurnRecord) -> None:
        """Put ``record`` in the pending table until :meth:`feedback` (or timeout/overflow drops it)."""
        self.sweep()
        with self._lock:
            while len(self._pending) >= self.max_pending:
                self._pending.popitem(last=False)
                self._counts["dropped_overflow"] += 1
            self._pending[record.request_id] = (record, self._clock() + self.pending_ttl_s)
            self._counts["pending"] += 1

    def feedback(self, request_id: str, reward: float | None, feedback: str | None = None) -> tuple[str, str | None]:
        """Give a pending turn its reward; ``(status, reason)`` as in :meth:`finish`, or ``("unknown", reason)``."""
        self.sweep()
        with self._lock:
            item = self._pending.pop(request_id, None)
            if item is None:
                self._counts["feedback_unknown"] += 1
                return "unknown", (f"no pending turn {request_id!r}: unknown id, already rewarded, or dropped after "
                                   f"{self.pending_ttl_s:g}s without feedback")
        return self.finish(item[0], reward, feedback)

    def withdraw(self, request_id: str) -> bool:
        """Remove a pending turn without an outcome (the caller counts why); False if it is not pending."""
        with self._lock:
            return self._pending.pop(request_id, None) is not None

    def is_pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending

    def sweep(self) -> int:
        """Drop pending turns whose deadline passed; returns how many were dropped."""
        now = self._clock()
        dropped = 0
        with self._lock:
            # Deadlines are insertion time + a constant TTL, so the table is ordered by deadline.
            while self._pending:
                _, (_, deadline) = next(iter(self._pending.items()))
                if deadline > now:
                    break
                self._pending.popitem(last=False)
                dropped += 1
            self._counts["dropped_timeout"] += dropped
        return dropped
