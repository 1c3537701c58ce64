"""Where recorded entries go: a local ``ReplayBuffer`` (tests, single process) or a ``ReplayBufferActor`` handle.

``submit(entries)`` never blocks its caller: it returns a ``concurrent.futures.Future`` that resolves to the number
of entries the buffer accepted (0: refused, e.g. a duplicate uid or stale on arrival) or raises when the write
failed (the actor died). ``fill()`` (optional for other sinks) reports the buffer's size and capacity, for the
per-key buffer share. The chat service answers ``accepted`` only once that future says so, so an
acknowledged reward is in the buffer; the chat response itself never waits for the write.

The actor sink puts the steps' tokens into Ray's object store once and fires ``handle.add.remote`` with the
reference (``claas_verl.claas.replay.store.send_format``); Ray resolves the call on its own thread. ``flush`` waits for
the writes in flight (tests, shutdown); ``healthy`` tells whether the buffer answers at all (``/health``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from claas_verl.claas.replay.store import send_format


def _done(value: int) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class LocalBufferSink:
    """Adds to a plain :class:`~claas_verl.claas.replay.ReplayBuffer` in the caller's thread (it is fast), under a
    lock."""

    def __init__(self, buffer):
        self.buffer = buffer
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self.last_error: str | None = None

    def submit(self, entries: list) -> concurrent.futures.Future:
        with self._lock:
            self._counts["submitted"] += len(entries)
            try:
                accepted = int(self.buffer.add(entries))
            except ValueError as exc:  # the buffer validates again: a refusal, answered as such
                self._counts["errors"] += len(entries)
                self.last_error = repr(exc)
                return _done(0)
            self._counts["accepted"] += accepted
            return _done(accepted)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def healthy(self, timeout_s: float = 2.0) -> bool:
        return True

    def fill(self, timeout_s: float = 2.0) -> tuple[int, int]:
        """``(entries held, capacity b_max)`` of the buffer."""
        with self._lock:
            return len(self.buffer), self.buffer.b_max

    def stats(self) -> dict:
        with self._lock:
            return {"submitted": self._counts["submitted"], "accepted": self._counts["accepted"],
                    "errors": self._counts["errors"], "in_flight": 0}


class ActorSink:
    """Writes to a ``ReplayBufferActor`` handle (anything with ``add.remote(entries)``), acknowledged by futures.

    ``on_accepted(entries, n_accepted)`` is called (on Ray's callback thread) after each write the buffer answered,
    with the number it accepted, before the write's future resolves: a training job feeds the REINFORCE++ EMA
    baseline from it, so that only rewards the buffer took count (docs/math.md §A.3.1). The chat service submits one
    entry per call, so ``n_accepted`` is 0 or 1.
    """

    def __init__(self, handle, on_accepted: Callable[[list, int], None] | None = None, tenant: str | None = None):
        self.handle = handle
        self.on_accepted = on_accepted
        self.tenant = tenant  # the replay partition written, sized and asked (None: the actor's implicit one)
        self._tenant_kw = {} if tenant is None else {"tenant": tenant}
        self.callback_errors = 0  # on_accepted raised (last_error holds the latest)
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._in_flight = 0
        self._counts: Counter = Counter()
        self.last_error: str | None = None
        self._health: tuple[float, bool] = (-1e9, True)  # (checked at, answer): one probe per second at most
        self._b_max: int | None = None

    def submit(self, entries: list) -> concurrent.futures.Future:
        n = len(entries)
        out: concurrent.futures.Future = concurrent.futures.Future()
        try:
            batch = send_format(self.handle, entries)  # Ray actor: steps put into the object store once, by reference
            ref = self.handle.add.remote(batch, **self._tenant_kw)
        except Exception as exc:  # refused before sending, or the actor is gone: the future carries the failure
            with self._lock:
                self._counts["submitted"] += n
                self._counts["errors"] += n
                self.last_error = repr(exc)
            out.set_exception(exc if isinstance(exc, ValueError) else RuntimeError(f"replay buffer write failed: "
                                                                                    f"{exc!r}"))
            return out
        with self._lock:
            self._in_flight += 1
            self._counts["submitted"] += n

        def on_done(fut) -> None:
            accepted, error = None, None
            with self._lock:
                try:
                    accepted = int(fut.result())
                    self._counts["accepted"] += accepted
                except Exception as exc:  # actor died / entry refused: the waiting client is told, and it is counted
                    self._counts["errors"] += n
                    self.last_error = repr(exc)
                    error = exc
            if accepted and self.on_accepted is not None:
                try:
                    self.on_accepted(entries, accepted)
                except Exception as exc:  # noqa: BLE001 - a callback bug must not wedge flush(); it is recorded
                    with self._lock:
                        self.callback_errors += 1
                        self.last_error = repr(exc)
            with self._lock:
                self._in_flight -= 1
                self._done.notify_all()
            if error is not None:
                out.set_exception(RuntimeError(f"replay buffer write failed: {error!r}"))
            else:
                out.set_result(accepted)

        ref.future().add_done_callback(on_done)
        return out

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted write completed; False on timeout."""
        with self._lock:
            return self._done.wait_for(lambda: not self._in_flight, timeout_s)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the actor answers a cheap call within ``timeout_s`` (cached for one second); blocking, so call it
        off the event loop. A handle without ``size`` (a stand-in) is taken as healthy."""
        checked, answer = self._health
        if time.monotonic() - checked < 1.0:
            return answer
        size = getattr(self.handle, "size", None)
        if size is None or not hasattr(size, "remote"):
            return True
        try:
            size.remote(**self._tenant_kw).future().result(timeout=timeout_s)
            answer = True
        except Exception:  # noqa: BLE001 - dead, unreachable or too slow: all mean "cannot take entries now"
            answer = False
        self._health = (time.monotonic(), answer)
        return answer

    def fill(self, timeout_s: float = 5.0) -> tuple[int, int]:
        """``(entries held, capacity b_max)`` of the actor's buffer (blocking: call it off the event loop; the
        capacity is asked once). Raises when the actor does not answer within ``timeout_s``."""
        if self._b_max is None:
            stats = self.handle.stats.remote(**self._tenant_kw).future().result(timeout=timeout_s)
            self._b_max = int(stats["b_max"])
        return int(self.handle.size.remote(**self._tenant_kw).future().result(timeout=timeout_s)), self._b_max

    def for_tenant(self, tenant: str) -> ActorSink:
        """A sink into ``tenant``'s partition of the same actor, with the same ``on_accepted``."""
        return type(self)(self.handle, on_accepted=self.on_accepted, tenant=tenant)

    def stats(self) -> dict:
        with self._lock:
            return {"submitted": self._counts["submitted"], "accepted": self._counts["accepted"],
                    "errors": self._counts["errors"], "in_flight": self._in_flight}


def make_sink(target: Any, tenant: str | None = None):
    """A sink for ``target``: a ``ReplayBuffer``, a Ray actor handle, or an object already implementing
    ``submit`` (returning a future of the accepted count) / ``flush`` / ``stats`` (``healthy`` optional).

    ``tenant`` (a multi-tenant service): the sink writes that tenant's partition only. ``target`` must then be
    partitioned: a :class:`~claas_verl.claas.replay.partitions.PartitionedReplay`, a replay actor built with
    ``partitions``, or a sink object with ``for_tenant(tenant)``; one plain buffer shared by every tenant is refused
    (one tenant's feedback would train another's adapter)."""
    from claas_verl.claas.replay.buffer import ReplayBuffer
    from claas_verl.claas.replay.partitions import PartitionedReplay

    if isinstance(target, PartitionedReplay):
        return LocalBufferSink(target.part(tenant))
    if tenant is not None:
        if isinstance(target, ReplayBuffer) or not (hasattr(target, "for_tenant")
                                                    or hasattr(getattr(target, "add", None), "remote")):
            raise ValueError(f"a multi-tenant service needs a replay sink partitioned by tenant (a PartitionedReplay, "
                             f"a replay actor built with partitions, or a sink with for_tenant); got "
                             f"{type(target).__name__}, which every tenant would share")
        if hasattr(target, "for_tenant"):
            return target.for_tenant(tenant)
        return ActorSink(target, tenant=tenant)
    if isinstance(target, ReplayBuffer):
        return LocalBufferSink(target)
    if all(hasattr(target, m) for m in ("submit", "flush", "stats")):
        return target
    add = getattr(target, "add", None)
    if add is not None and hasattr(add, "remote"):
        return ActorSink(target)
    raise ValueError(
        f"sink must be a ReplayBuffer, a ReplayBufferActor handle or an object with submit/flush/stats, "
        f"got {type(target).__name__}"
    )
