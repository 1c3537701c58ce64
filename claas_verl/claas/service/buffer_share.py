"""Each API key's share of the replay buffer: one key's rewarded turns never crowd the others out of it.

The buffer keeps the last ``B_max`` accepted entries (FIFO) and drops old-policy entries at updates (age), and the
trainer samples uniformly from what it holds; a key that writes most of the entries thus shapes most of the
gradient. The service remembers the owner (key id) of each of the last ``B_max`` entries it wrote. FIFO makes that
window an upper bound of what a key can still hold in the buffer; age eviction only lowers the real count.

A key may hold at most ``share * B_max`` entries (at least one) when its next entry would push another key's entry
out: the buffer is full and its oldest entry is not the key's own (or is not attributed to any key: an entry from
before a resume, or from the job's own producers). Free space and the key's own oldest entries stay usable, so a
share below 1 never idles the buffer and one key alone is never blocked. Writes in flight are reserved, so
concurrent feedback of one key cannot overshoot the limit.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque

#: the key id exempt from the share (the operator's own key)
EXEMPT = ("admin",)


class BufferShare:
    """Per-key accounting of the service's last ``capacity`` accepted entries (thread-safe).

    ``limit(capacity)`` entries per key; ``reserve(owner, size, capacity)`` before a write (False: refused),
    ``release(owner, accepted)`` once the buffer answered (or the write never happened).
    """

    def __init__(self, share: float):
        self.share = float(share)
        self._lock = threading.Lock()
        self._window: deque[str] = deque()  # owners of the last `capacity` accepted entries, oldest first
        self._held: Counter = Counter()
        self._in_flight: Counter = Counter()
        self.capacity: int | None = None  # B_max, learned from the sink on first use

    @property
    def enabled(self) -> bool:
        return self.share < 1.0

    def limit(self, capacity: int) -> int:
        return max(1, math.floor(self.share * capacity))

    def needs_fill(self, owner: str) -> bool:
        """Whether admitting ``owner`` depends on the buffer's fill (else it is admitted without asking the sink)."""
        if not self.enabled:
            return False
        if self.capacity is None:
            return True
        if owner in EXEMPT:
            return False
        with self._lock:
            return self._held[owner] + self._in_flight[owner] >= self.limit(self.capacity)

    def reserve(self, owner: str, size: int | None = None, capacity: int | None = None) -> bool:
        """Reserve a write for ``owner``; False when it is at its share and its entry would push another key's
        entry (or an unattributed one) out of a full buffer of ``size`` entries."""
        with self._lock:
            if capacity is not None:
                self._set_capacity(capacity)
            if self.enabled and owner not in EXEMPT and self.capacity is not None:
                at_share = self._held[owner] + self._in_flight[owner] >= self.limit(self.capacity)
                full = (size if size is not None else len(self._window)) + sum(self._in_flight.values()) \
                    >= self.capacity
                # the entry a write would push out is the window's oldest only if the window covers the buffer
                own_oldest = bool(self._window) and self._window[0] == owner and len(self._window) >= (size or 0)
                if at_share and full and not own_oldest:
                    return False
            self._in_flight[owner] += 1
            return True

    def release(self, owner: str, accepted: bool) -> None:
        """End ``owner``'s reserved write; an accepted entry enters the window (pushing its oldest out when full)."""
        with self._lock:
            self._in_flight[owner] -= 1
            if self._in_flight[owner] <= 0:
                del self._in_flight[owner]
            if accepted:
                self._window.append(owner)
                self._held[owner] += 1
                if self.capacity is not None:
                    self._trim()

    def held(self) -> dict[str, int]:
        """Entries each key may still hold in the buffer (its count in the window)."""
        with self._lock:
            return {k: v for k, v in self._held.items() if v}

    def _set_capacity(self, capacity: int) -> None:  # with the lock held
        if capacity < 1:
            raise ValueError(f"the replay buffer reports capacity {capacity}; the buffer share needs b_max >= 1")
        self.capacity = int(capacity)
        self._trim()

    def _trim(self) -> None:  # with the lock held
        while len(self._window) > self.capacity:
            gone = self._window.popleft()
            self._held[gone] -= 1
            if not self._held[gone]:
                del self._held[gone]
