"""Turn served responses into replay entries (docs/math.md §A.1.1, A.1.4) and hold them until their reward arrives.

One assistant turn becomes one :class:`~claas_verl.claas.replay.ReplayEntry` (entry unit ``"step"``, docs/math.md
§A.1.5):

* ``prompt_ids``: the full chat context as templated for the policy; ``response_ids``: the sampled tokens incl. EOS;
* ``behaviour_logprob = Σ_j log π_β(y_j | x, y_<j)`` summed over exactly ``response_ids`` (the tokens with m=1);
* ``P``: the policy version that served the request (captured when it started, docs/math.md §A.1.1);
* ``uid``: the request id, so a retried write is idempotent in the buffer.

The reward comes from a grader (immediately) or from ``POST /v1/feedback``; until then the turn waits in a bounded
pending table. Reward ``None`` (grader error) drops the turn before it reaches the buffer (docs/math.md §A.1.4); so do a
pending turn's timeout and the table's overflow (its oldest turn goes). Every outcome is counted. (With SDPO the
service turns feedback text sent with reward ``None`` into an entry before it gets here:
:mod:`~claas_verl.claas.service.teacher`.)
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from claas_verl.claas.replay.entry import ReplayEntry
from claas_verl.claas.service.backend import Generation

COUNTERS = (
    "served",  # responses returned to clients
    "not_recorded",  # the client opted out (metadata record=false / X-Claas-Record: 0) or recording is off
    "rejected_sampling",  # docs/math.md §0: not τ=1 / top_p=1 / top_k off
    "rejected_unrecordable",  # backend gave no prompt ids or per-token log-probs, no scenario id, ...
    "rejected_invalid",  # ReplayEntry validation refused the turn
    "rejected_busy",  # the grading queue was full: the chat was answered 429 before generating
    "rate_limited",  # requests answered 429 by the per-key rate limit
    "rejected_buffer_share",  # feedback answered 429: the key holds its share of the buffer (the turn stays pending)
    "pending",  # turns put in the pending table (cumulative)
    "graded",  # turns handed to the grader (cumulative)
    "submitted",  # entries handed to the sink
    "accepted",  # entries the replay buffer acknowledged
    "dropped_reward_none",  # reward None from a grader or from feedback (docs/math.md §A.1.4)
    "dropped_grader_error",  # the grader raised
    "dropped_timeout",  # no feedback within pending_ttl_s
    "dropped_overflow",  # a key's pending share (or the whole table) full: its oldest turn was dropped
    "dropped_pending_bytes",  # the pending table's byte budget full: the oldest turn of the largest holder dropped
    "dropped_aborted",  # the generation was aborted/cut by the server (finish reason not stop/length)
    "dropped_mixed_version",  # the response's tokens came from more than one policy version
    "dropped_disconnected",  # a streaming client went away before the final chunk (generation stopped or withdrawn)
    "dropped_stream_error",  # the backend failed after a stream started (the client got an error event)
    "dropped_buffer_refused",  # the buffer answered but refused the entry (duplicate uid, stale on arrival)
    "dropped_buffer_error",  # the write failed (replay actor dead or unreachable): the client got a 503
    "dropped_unconfirmed",  # the buffer did not acknowledge in time: the client got a 503 (outcome unknown)
    "dropped_buffer_share",  # a graded turn of a key holding its share of the buffer (no client to retry it)
    "dropped_shutdown",  # pending or grading turns still open when the service stopped
    "feedback_unknown",  # feedback for an unknown / already finished / expired / another key's request id
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
    messages: list = field(default_factory=list)  # for the grader, and SDPO's teacher context
    text: str = ""
    template_kwargs: dict | None = None  # the chat's template arguments (SDPO renders its teacher context with them)
    owner: str = "local"  # id of the API key that created the turn: only it may give the turn's feedback

    def nbytes(self) -> int:
        """What the turn costs while it waits (token arrays, texts, metadata), for the pending byte budget."""
        ids = np.asarray(self.prompt_ids).nbytes + np.asarray(self.response_ids).nbytes
        texts = len(self.text) + sum(len(m.get("content", "")) for m in self.messages)
        return int(ids + texts + len(repr(self.metadata)) + 256)


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
    """ℓ^b = Σ_j log π_β(y_j | ·) over every response token (docs/math.md §A.1.1), summed exactly (``math.fsum``).

    Clamped at 0: each term is <= 0, so a positive sum is only bf16/fp16 rounding of many ~0 terms.
    """
    return min(math.fsum(token_logprobs), 0.0)


class TrajectoryRecorder:
    """Builds entries, holds turns awaiting feedback and hands entries to a sink (thread-safe).

    The pending table is shared fairly between API keys: each key holds at most ``max_pending_per_key`` turns (a
    new one beyond that drops that key's oldest), and when the whole table is full, by count (``max_pending``) or by
    bytes (``max_pending_bytes``), the oldest turn of the key holding the most bytes goes. One key's traffic thus
    never evicts another key's turns while it holds more than they do. Every drop is counted by reason, per key too.

    Args:
        sink: see :mod:`claas_verl.claas.service.sinks` (``submit`` -> future, ``flush``, ``stats``).
        max_pending / max_pending_per_key / max_pending_bytes: bounds of the pending table (None: no per-key bound).
        pending_ttl_s: a pending turn without feedback for this long is dropped (counted) at the next sweep.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, sink, *, max_pending: int = 4096, pending_ttl_s: float = 600.0,
                 max_pending_per_key: int | None = None, max_pending_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if max_pending_per_key is not None and max_pending_per_key < 1:
            raise ValueError(f"max_pending_per_key must be None or >= 1, got {max_pending_per_key}")
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be >= 1, got {max_pending_bytes}")
        if not pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s}")
        self.sink = sink
        self.max_pending = int(max_pending)
        self.max_pending_per_key = int(max_pending_per_key or max_pending)
        self.max_pending_bytes = int(max_pending_bytes)
        self.pending_ttl_s = float(pending_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        # request id -> (turn, deadline, bytes); insertion order is deadline order (constant TTL)
        self._pending: OrderedDict[str, tuple[TurnRecord, float, int]] = OrderedDict()
        self._by_owner: dict[str, OrderedDict[str, None]] = {}
        self._owner_bytes: Counter = Counter()
        self._bytes = 0
        self._counts: Counter = Counter()
        self._per_key: dict[str, Counter] = {}

    # ------------------------------------------------------------------ counting
    def count(self, name: str, n: int = 1, owner: str | None = None) -> None:
        if name not in COUNTERS:
            raise ValueError(f"unknown counter {name!r}; one of {COUNTERS}")
        with self._lock:
            self._count(name, n, owner)

    def _count(self, name: str, n: int, owner: str | None) -> None:  # with the lock held
        self._counts[name] += n
        if owner is not None:
            self._per_key.setdefault(owner, Counter())[name] += n

    def stats(self) -> dict:
        """Every counter, the current pending-table size and bytes, and the sink's counters under ``sink``."""
        self.sweep()
        with self._lock:
            out = {name: self._counts[name] for name in COUNTERS}
            out["pending_now"] = len(self._pending)
            out["pending_bytes"] = self._bytes
        out["sink"] = self.sink.stats()
        return out

    def key_stats(self, owner: str | None = None) -> dict:
        """Per-key counters (non-zero ones) and pending turns: every key's, or ``owner``'s only."""
        self.sweep()
        with self._lock:
            owners = sorted(set(self._per_key) | set(self._by_owner)) if owner is None else [owner]
            return {o: {**{k: v for k, v in self._per_key.get(o, Counter()).items() if v},
                        "pending_now": len(self._by_owner.get(o, ())), "pending_bytes": self._owner_bytes[o]}
                    for o in owners}

    # ------------------------------------------------------------------ outcomes
    def finish(self, record: TurnRecord, reward: float | None, feedback: str | None, metadata: dict | None = None
               ) -> tuple[str, str | None, concurrent.futures.Future | None]:
        """Turn ``record`` into an entry with ``reward`` (and ``metadata`` added to the turn's own, e.g. SDPO's
        teacher context) and submit it: ``(status, reason, ack)``.

        ``("submitted", None, ack)``: ``ack`` resolves to the number of entries the buffer accepted (see
        :mod:`~claas_verl.claas.service.sinks`); ``("dropped", reason, None)``: reward None (docs/math.md §A.1.4);
        ``("rejected", reason, None)``: the entry failed validation.
        """
        if reward is None:
            self.count("dropped_reward_none", owner=record.owner)
            return "dropped", "reward None (grader error): never used for training (docs/math.md §A.1.4)", None
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
                metadata={**record.metadata, **(metadata or {})},
                P=record.policy_version,
            )
        except (ValueError, OverflowError) as exc:
            self.count("rejected_invalid", owner=record.owner)
            return "rejected", f"invalid entry: {exc}", None
        ack = self.sink.submit([entry])
        self.count("submitted", owner=record.owner)
        return "submitted", None, ack

    def hold(self, record: TurnRecord) -> bool:
        """Put ``record`` in the pending table until :meth:`feedback` (or timeout/overflow drops it). False (counted)
        when the turn alone exceeds the byte budget."""
        self.sweep()
        size = record.nbytes()
        with self._lock:
            if size > self.max_pending_bytes:
                self._count("dropped_pending_bytes", 1, record.owner)
                return False
            own = self._by_owner.setdefault(record.owner, OrderedDict())
            while len(own) >= self.max_pending_per_key:
                self._evict(next(iter(own)), "dropped_overflow")
            while len(self._pending) >= self.max_pending or self._bytes + size > self.max_pending_bytes:
                largest = max(self._by_owner, key=lambda o: (self._owner_bytes[o], len(self._by_owner[o])))
                reason = "dropped_overflow" if len(self._pending) >= self.max_pending else "dropped_pending_bytes"
                self._evict(next(iter(self._by_owner[largest])), reason)
            self._pending[record.request_id] = (record, self._clock() + self.pending_ttl_s, size)
            self._by_owner.setdefault(record.owner, OrderedDict())[record.request_id] = None
            self._owner_bytes[record.owner] += size
            self._bytes += size
            self._count("pending", 1, record.owner)
        return True

    def _evict(self, request_id: str, reason: str | None) -> TurnRecord:  # with the lock held
        record, _, size = self._pending.pop(request_id)
        own = self._by_owner[record.owner]
        del own[request_id]
        if not own:
            del self._by_owner[record.owner]
        self._owner_bytes[record.owner] -= size
        self._bytes -= size
        if reason is not None:
            self._count(reason, 1, record.owner)
        return record

    def take(self, request_id: str, owner: str) -> TurnRecord | None:
        """Remove and return ``owner``'s pending turn ``request_id``; None (counted ``feedback_unknown``) if there is
        none, or if it belongs to another key (which is then left untouched, and not told it exists)."""
        self.sweep()
        with self._lock:
            item = self._pending.get(request_id)
            if item is None or item[0].owner != owner:
                self._count("feedback_unknown", 1, owner)
                return None
            return self._evict(request_id, None)

    def owns(self, request_id: str, owner: str) -> bool:
        """Whether ``request_id`` is pending and ``owner``'s (nothing is counted or changed)."""
        with self._lock:
            item = self._pending.get(request_id)
            return item is not None and item[0].owner == owner

    def unknown_reason(self, request_id: str) -> str:
        return (f"no pending turn {request_id!r} for this API key: unknown id, another key's turn, already rewarded, "
                f"or dropped after {self.pending_ttl_s:g}s without feedback")

    def withdraw(self, request_id: str) -> bool:
        """Remove a pending turn without an outcome (the caller counts why); False if it is not pending."""
        with self._lock:
            if request_id not in self._pending:
                return False
            self._evict(request_id, None)
            return True

    def drop_all(self, reason: str = "dropped_shutdown") -> int:
        """Drop every pending turn (the service stops), counted under ``reason``; returns how many."""
        with self._lock:
            n = len(self._pending)
            for request_id in list(self._pending):
                self._evict(request_id, reason)
            return n

    def is_pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending

    def sweep(self) -> int:
        """Drop pending turns whose deadline passed; returns how many were dropped."""
        now = self._clock()
        dropped = 0
        with self._lock:
            while self._pending:
                request_id, (_, deadline, _) = next(iter(self._pending.items()))
                if deadline > now:
                    break
                self._evict(request_id, "dropped_timeout")
                dropped += 1
        return dropped
