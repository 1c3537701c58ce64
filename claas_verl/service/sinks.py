"""Where recorded entries go: a local ``ReplayBuffer`` (tests, single process) or a ``ReplayBufferActor`` handle.

A sink's ``submit(entries)`` never waits for the buffer: the chat response must not pay for the write. The actor
sink puts the steps' tokens into Ray's object store once and fires ``handle.add.remote`` with the reference
(``claas_verl.replay.store.send_format``) and counts the outcome when the call completes (Ray runs the callback on
its own thread); ``flush`` waits for the writes in flight, for tests and shutdown.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from claas_verl.replay.store import send_format


class LocalBufferSink:
    """Adds to a plain :class:`~claas_verl.replay.ReplayBuffer` in the caller's thread (it is fast), under a lock."""

    def __init__(self, buffer):
        self.buffer = buffer
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self.last_error: str | None = None

    def submit(self, entries: list) -> None:
        with self._lock:
            self._counts["submitted"] += len(entries)
            try:
                self._counts["accepted"] += int(self.buffer.add(entries))
            except ValueError as exc:  # the buffer validates again; a refusal must not break the chat
                self._counts["errors"] += len(entries)
                self.last_error = repr(exc)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def stats(self) -> dict:
        with self._lock:
            return {"submitted": self._counts["submitted"], "accepted": self._counts["accepted"],
                    "errors": self._counts["errors"], "in_flight": 0}


class ActorSink:
    """Fire-and-forget writes to a ``ReplayBufferActor`` handle (anything with ``add.remote(entries)``).

    ``on_accepted(entries, n_accepted)`` is called (on Ray's callback thread) after each write the buffer answered,
    with the number it accepted: a training job feeds the REINFORCE++ EMA baseline from it, so that only rewards the
    buffer took count (SPEC A.3.1). The chat service submits one entry per call, so ``n_accepted`` is 0 or 1.
    """

    def __init__(self, handle, on_accepted: Callable[[list, int], None] | None = None):
        self.handle = handle
        self.on_accepted = on_accepted
        self.callback_errors = 0  # on_accepted raised (last_error holds the latest)
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._in_flight = 0
        self._counts: Counter = Counter()
        self.last_error: str | None = None

    def submit(self, entries: list) -> None:
        n = len(entries)
        try:
            batch = send_format(self.handle, entries)  # Ray actor: steps put into the object store once, by reference
        except ValueError as exc:  # refused before sending: counted, never raised into the chat path
            with self._lock:
                self._counts["submitted"] += n
                self._counts["errors"] += n
                self.last_error = repr(exc)
            return
        ref = self.handle.add.remote(batch)
        with self._lock:
            self._in_flight += 1
            self._counts["submitted"] += n

        def on_done(fut) -> None:
            accepted = None
            with self._lock:
                try:
                    accepted = int(fut.result())
                    self._counts["accepted"] += accepted
                except Exception as exc:  # actor died / entry refused: counted, never raised into the chat path
                    self._counts["errors"] += n
                    self.last_error = repr(exc)
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

        ref.future().add_done_callback(on_done)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted write completed; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(left)
        return True

    def stats(self) -> dict:
        with self._lock:
            return {"submitted": self._counts["submitted"], "accepted": self._counts["accepted"],
                    "errors": self._counts["errors"], "in_flight": self._in_flight}


def make_sink(target: Any):
    """A sink for ``target``: a ``ReplayBuffer``, a Ray actor handle, or an object already implementing
    ``submit``/``flush``/``stats``."""
    from claas_verl.replay.buffer import ReplayBuffer

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
