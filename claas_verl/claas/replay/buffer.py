"""The CLaaS replay buffer as a plain Python class (docs/math.md §A.1, Algorithm 1 of the CLaaS paper (zh)).
No Ray import.

State (docs/math.md §A.1.2): the entries in insertion order (``ReplayEntry``, or ``EntryRef`` for entries held by
reference), the update counter ``k`` and, in the Ray actor, one lock that serialises every call (the "one lock shared by
the two processes").

Lifetime rules:
- FIFO: after every ``add``, ``while len > b_max: pop oldest`` (docs/math.md §A.1.3 step 4).
- Age: ``on_update`` does ``k += 1`` and evicts every entry with ``k - P > a_max`` (strict ``>``, docs/math.md §A.1.6),
  so an entry inserted with ``P = p`` can be sampled at update indices ``p … p + a_max``: in at most ``a_max + 1``
  updates.
- Reward ``None``: dropped before insertion, never counted toward ``b_min``/``b_max`` (docs/math.md §A.1.4).
- Stale on arrival: an entry with ``k - P > a_max`` at insertion is dropped (counted), so every stored entry satisfies
  ``k - P <= a_max`` at all times (the invariant Algorithm 1's filter establishes after each update).

Bad input [design choice]: ``add`` validates the WHOLE batch before inserting anything. One malformed entry makes the
call raise ``ValueError`` naming the entry index and the field, and the buffer is left exactly as it was (all or
nothing, so a producer can fix and resend the batch without creating duplicates). Entries whose uid is already stored
(or repeated in the batch) are skipped and counted, which makes a retried ``add`` idempotent.

Use accounting: besides the number of draws, every entry counts the number of DISTINCT update indices ``k`` at
which it was sampled (several ``sample`` calls between two ``on_update`` calls count once). ``stats()["max_uses"]``
is therefore bounded by ``a_max + 1``, which trainers may assert.
"""

from __future__ import annotations

import copy
import random
import warnings
from collections import Counter
from typing import Any

import numpy as np

from claas_verl.claas.replay.entry import ENTRY_UNITS, ReplayEntry, ScenarioEntry, _is_int
from claas_verl.claas.replay.packed import PackedEntries
from claas_verl.claas.replay.refs import EntryRef, RefBatch

_STATE_FORMAT = 1
_COUNTERS = (
    "inserted",  # accepted into the buffer (even if a later FIFO pop in the same add removed it)
    "dropped_none",  # reward None (docs/math.md §A.1.4)
    "dropped_duplicate",  # uid already stored or repeated in the batch
    "dropped_stale",  # k - P > a_max already at insertion
    "rejected_batches",  # add calls refused because an entry was malformed
    "evicted_fifo",
    "evicted_age",
    "sampled",  # entries drawn, summed over sample calls
    "sample_calls",
    "future_version_clamped",  # entries whose P was > k (see ReplayBuffer.add)
)


def validate_replay_sizes(m: int, b_min: int, b_max: int, expected_entries_per_split: int | None = None) -> None:
    """Check ``1 <= M <= B_min <= B_max`` (docs/math.md §A.1.6 [CHOICE]); raise ``ValueError`` naming the argument.

    This is what guarantees ``len(buffer) >= M`` whenever a ready buffer is sampled. When
    ``expected_entries_per_split`` is given, warn if ``B_min`` exceeds it (docs/math.md §A.1.8: with ``B_min=100`` and
    20 scenarios × <=4 steps, training never starts in a split).
    """
    for name, value in (("m", m), ("b_min", b_min), ("b_max", b_max)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if m > b_min:
        raise ValueError(f"m (minibatch size) = {m} must be <= b_min = {b_min} so that a ready buffer holds m entries")
    if b_min > b_max:
        raise ValueError(f"b_min = {b_min} must be <= b_max = {b_max}, otherwise the buffer can never become ready")
    if expected_entries_per_split is not None and b_min > expected_entries_per_split:
        warnings.warn(
            f"b_min = {b_min} exceeds the {expected_entries_per_split} entries one split can produce: training will "
            "not start within a split and 'train until |B| < b_min' is vacuous (docs/math.md §A.1.8); lower b_min",
            UserWarning,
            stacklevel=2,
        )


def expected_entries_per_split(n_scenarios: int, max_steps: int, entry_unit: str = "step") -> int:
    """Upper bound on entries one split adds: ``n_scenarios * max_steps`` per step, ``n_scenarios`` per scenario."""
    if entry_unit not in ENTRY_UNITS:
        raise ValueError(f"entry_unit must be one of {ENTRY_UNITS}, got {entry_unit!r}")
    return n_scenarios * max_steps if entry_unit == "step" else n_scenarios


class _Slot:
    """A stored entry plus its use accounting (kept outside the entry so entries stay plain records)."""

    __slots__ = ("entry", "uses", "last_used_k", "draws")

    def __init__(self, entry, uses: int = 0, last_used_k: int = -1, draws: int = 0):
        self.entry = entry
        self.uses = uses  # distinct update indices k at which the entry was sampled
        self.last_used_k = last_used_k
        self.draws = draws  # raw number of times drawn


class ReplayBuffer:
    """Bounded FIFO replay buffer with age-based eviction in gradient updates (docs/math.md §A.1).

    Args:
        b_max: capacity (FIFO eviction beyond it), ``>= b_min``.
        b_min: readiness threshold: the trainer samples only when ``len >= b_min``; ``>= 1``.
        a_max: maximum age ``k - P`` an entry may reach and still be kept; ``>= 0``.
        seed: seed of the sampling RNG (``random.Random``); its state is part of ``state_dict``.
        entry_unit: ``"step"`` (holds :class:`ReplayEntry`) or ``"scenario"`` (holds :class:`ScenarioEntry`);
            ``b_max``/``b_min``/``M`` count elements of that unit (docs/math.md §A.1.5).
    """

    def __init__(self, b_max: int, b_min: int, a_max: int, seed: int | None = None, *, entry_unit: str = "step"):
        if not _is_int(b_min) or b_min < 1:
            raise ValueError(f"b_min must be an int >= 1, got {b_min!r}")
        if not _is_int(b_max) or b_max < b_min:
            raise ValueError(f"b_max must be an int >= b_min = {b_min}, got {b_max!r}")
        if not _is_int(a_max) or a_max < 0:
            raise ValueError(f"a_max must be an int >= 0, got {a_max!r}")
        if entry_unit not in ENTRY_UNITS:
            raise ValueError(f"entry_unit must be one of {ENTRY_UNITS}, got {entry_unit!r}")
        self.b_max, self.b_min, self.a_max = int(b_max), int(b_min), int(a_max)
        self.entry_unit = entry_unit
        self._entry_type = ReplayEntry if entry_unit == "step" else ScenarioEntry
        # A step buffer also holds EntryRef (entries held by reference, refs.py); Algorithm 1 reads only uid,
        # reward, P and seq, which both carry.
        self._stored_types = (ReplayEntry, EntryRef) if entry_unit == "step" else (ScenarioEntry,)
        self._rng = random.Random(seed)
        self._k = 0
        self._next_seq = 0
        self._slots: list[_Slot] = []  # insertion order == seq order
        self._uids: set[str] = set()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._uses_at_eviction: Counter = Counter()  # uses -> number of evicted entries

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._slots)

    @property
    def update_count(self) -> int:
        """k: number of completed optimizer steps (``on_update`` calls)."""
        return self._k

    def ready(self) -> bool:
        """``len >= b_min`` (docs/math.md §A.1.6 ``wait until |B| >= B_min``)."""
        return len(self._slots) >= self.b_min

    def entries(self) -> list:
        """Shallow copies of the stored entries in insertion order (for inspection and tests)."""
        return [copy.copy(s.entry) for s in self._slots]

    # ------------------------------------------------------------------ mutations
    def add(self, entry_or_entries: Any) -> int:
        """Insert one entry, a list of entries, a :class:`PackedEntries` batch or (reference path) a
        :class:`~claas_verl.claas.replay.refs.RefBatch`; return how many were accepted.

        All or nothing on bad input: every entry is validated first, and a malformed one raises ``ValueError``
        ("entries[i]: field ...") with nothing inserted. Then, in order: reward ``None`` -> dropped (counted);
        uid already present -> skipped (counted); otherwise a shallow copy stamped with ``seq`` and
        ``P = entry.resolve_version(k)`` is appended. A ``P`` greater than ``k`` (weights published before
        ``on_update`` was called) is clamped to ``k`` and counted in ``future_version_clamped``: a later version
        would let the entry outlive ``a_max + 1`` updates. An entry already too old (``k - P > a_max``) is dropped
        and counted in ``dropped_stale``: Algorithm 1 would evict it at the next update, and sampling it before
        then would exceed the staleness bound. Finally FIFO-evict down to ``b_max``.
        """
        try:
            batch, owned = self._checked_batch(entry_or_entries)
        except ValueError:
            self._counters["rejected_batches"] += 1
            raise

        accepted = 0
        for entry in batch:
            if entry.reward is None:
                self._counters["dropped_none"] += 1
                continue
            if entry.uid in self._uids:
                self._counters["dropped_duplicate"] += 1
                continue
            version = entry.resolve_version(self._k)
            if version > self._k:
                self._counters["future_version_clamped"] += 1
                version = self._k
            if self._k - version > self.a_max:
                # Already past its lifetime (served by weights more than a_max updates old): the next on_update
                # would evict it unused, and sampling it before then would break the staleness bound.
                self._counters["dropped_stale"] += 1
                continue
            stored = entry if owned else copy.copy(entry)
            stored.P, stored.seq = version, self._next_seq
            if not owned:
                stored.metadata = dict(stored.metadata)  # the caller may keep editing its dict
            self._next_seq += 1
            self._slots.append(_Slot(stored))
            self._uids.add(stored.uid)
            accepted += 1
        self._counters["inserted"] += accepted

        overflow = len(self._slots) - self.b_max
        if overflow > 0:
            for slot in self._slots[:overflow]:
                self._forget(slot)
            del self._slots[:overflow]
            self._counters["evicted_fifo"] += overflow
        return accepted

    def _checked_batch(self, entry_or_entries: Any) -> tuple[list, bool]:
        """The validated list of entries to insert, and whether they were built here (so ``add`` may store them
        without defensive copies). Raises ``ValueError`` naming the entry and field; nothing is stored."""
        if isinstance(entry_or_entries, (PackedEntries, RefBatch)):
            if self.entry_unit != "step":
                raise ValueError(f"{type(entry_or_entries).__name__} holds step entries but this buffer has "
                                 "entry_unit='scenario'; add a list of ScenarioEntry instead")
            if isinstance(entry_or_entries, RefBatch):
                return entry_or_entries.to_entry_refs(), True  # validated column-wise, fresh objects
            return entry_or_entries.to_entries(), True
        if isinstance(entry_or_entries, (ReplayEntry, ScenarioEntry, EntryRef)):
            batch = [entry_or_entries]
        elif isinstance(entry_or_entries, (list, tuple)):
            batch = list(entry_or_entries)
        else:
            raise ValueError(
                f"add expects a {self._entry_type.__name__}, a list of them or (step unit) a PackedEntries, "
                f"got {type(entry_or_entries).__name__}"
            )
        for i, entry in enumerate(batch):
            if not isinstance(entry, self._stored_types):
                raise ValueError(
                    f"entries[{i}] is a {type(entry).__name__} but this buffer has entry_unit="
                    f"{self.entry_unit!r} and holds {self._entry_type.__name__}"
                )
            try:
                entry.validate()
            except ValueError as exc:
                raise ValueError(f"entries[{i}] (uid={getattr(entry, 'uid', None)!r}): {exc}") from exc
        return batch, False

    def sample(self, m: int) -> list:
        """Draw ``m`` distinct entries uniformly without replacement (docs/math.md §A.1.6); return shallow copies.

        The copies share the read-only token arrays (and, for scenarios, the step objects) with the stored entries:
        treat them as read-only. Through the Ray actor they are deserialised copies anyway.

        Raises ``ValueError`` if ``m < 1``, if the buffer is not ready (``len < b_min``) or if ``m > len``.
        """
        if not _is_int(m) or m < 1:
            raise ValueError(f"m must be an int >= 1, got {m!r}")
        if not self.ready():
            raise ValueError(f"buffer not ready: {len(self._slots)} entries < b_min = {self.b_min}; wait_ready first")
        if m > len(self._slots):
            raise ValueError(f"m = {m} exceeds the {len(self._slots)} stored entries; keep m <= b_min")
        picked = self._rng.sample(range(len(self._slots)), m)
        out = []
        for i in picked:
            slot = self._slots[i]
            slot.draws += 1
            if slot.last_used_k != self._k:  # one use per update index, however often it is drawn
                slot.uses += 1
                slot.last_used_k = self._k
            out.append(copy.copy(slot.entry))
        self._counters["sampled"] += m
        self._counters["sample_calls"] += 1
        return out

    def batch_handles(self) -> list:
        """The distinct batch handles that stored EntryRefs point to, oldest first (reference path)."""
        seen: dict = {}
        for s in self._slots:
            h = getattr(s.entry, "handle", None)
            if h is not None:
                seen.setdefault(id(h), h)
        return list(seen.values())

    def on_update(self) -> int:
        """``k += 1`` then evict every entry with ``k - P > a_max`` (strict); return how many were evicted."""
        self._k += 1
        keep, evicted = [], 0
        for slot in self._slots:
            if self._k - slot.entry.P > self.a_max:
                self._forget(slot)
                evicted += 1
            else:
                keep.append(slot)
        self._slots = keep
        self._counters["evicted_age"] += evicted
        return evicted

    def _forget(self, slot: _Slot) -> None:
        self._uids.discard(slot.entry.uid)
        self._uses_at_eviction[slot.uses] += 1

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Counters and age/use figures (all plain Python numbers, safe to log).

        ``uses_at_eviction`` maps "number of distinct updates an entry was sampled in" to how many evicted entries
        had it; ``max_uses`` is the maximum over evicted AND stored entries (invariant: ``<= a_max + 1``).
        """
        ages = [self._k - s.entry.P for s in self._slots]
        stored_uses = [s.uses for s in self._slots]
        evicted_total = sum(self._uses_at_eviction.values())
        evicted_uses = sum(u * c for u, c in self._uses_at_eviction.items())
        return {
            "size": len(self._slots),
            "update_count": self._k,
            "b_max": self.b_max,
            "b_min": self.b_min,
            "a_max": self.a_max,
            **self._counters,
            "mean_age": float(np.mean(ages)) if ages else 0.0,
            "max_age": max(ages) if ages else 0,
            "uses_at_eviction": dict(sorted(self._uses_at_eviction.items())),
            "mean_uses_at_eviction": evicted_uses / evicted_total if evicted_total else 0.0,
            "max_uses": max([*stored_uses, *self._uses_at_eviction.keys()], default=0),
            "max_draws": max((s.draws for s in self._slots), default=0),
            "stored_nbytes": int(sum(s.entry.nbytes for s in self._slots)),
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to resume exactly, including the RNG state. Entries are shared, not deep-copied
        (they are immutable records with read-only token arrays), so this is cheap to take."""
        return {
            "format": _STATE_FORMAT,
            "config": {"b_max": self.b_max, "b_min": self.b_min, "a_max": self.a_max, "entry_unit": self.entry_unit},
            "k": self._k,
            "next_seq": self._next_seq,
            "slots": [(s.entry, s.uses, s.last_used_k, s.draws) for s in self._slots],
            "counters": dict(self._counters),
            "uses_at_eviction": dict(self._uses_at_eviction),
            "rng_state": self._rng.getstate(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`. The config must match this buffer's (raise ``ValueError`` naming the
        field otherwise); entries are re-validated. On error the buffer is left unchanged."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"state must be a dict from ReplayBuffer.state_dict (format {_STATE_FORMAT})")
        for name, value in state["config"].items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"state was saved with {name}={value!r} but this buffer has {name}={getattr(self, name)!r}"
                )
        slots = []
        for i, (entry, uses, last_used_k, draws) in enumerate(state["slots"]):
            if not isinstance(entry, self._stored_types):
                raise ValueError(f"state slots[{i}] holds a {type(entry).__name__}, expected {self._entry_type}")
            entry.validate()
            slots.append(_Slot(entry, uses, last_used_k, draws))
        rng = random.Random()
        rng.setstate(state["rng_state"])
        self._k, self._next_seq, self._slots, self._rng = int(state["k"]), int(state["next_seq"]), slots, rng
        self._uids = {s.entry.uid for s in slots}
        self._counters = {**dict.fromkeys(_COUNTERS, 0), **state["counters"]}
        self._uses_at_eviction = Counter(state["uses_at_eviction"])

    @classmethod
    def from_state_dict(cls, state: dict, seed: int | None = None) -> ReplayBuffer:
        """Build a buffer with the saved config and restore it."""
        buf = cls(
            **{k: v for k, v in state["config"].items() if k != "entry_unit"},
            seed=seed,
            entry_unit=state["config"]["entry_unit"],
        )
        buf.load_state_dict(state)
        return buf
