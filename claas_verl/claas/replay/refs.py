"""Entries held by reference: the replay actor keeps metadata, the token bytes stay in Ray's object store.

A producer puts the token buffer of one :class:`~claas_verl.claas.replay.packed.PackedEntries` batch into the object
store ONCE (``claas_verl.claas.replay.store.put_batch``) and sends the actor a :class:`RefBatch`: the batch's columns
without their tokens plus a :class:`BatchHandle` that holds the object reference. The buffer stores one
:class:`EntryRef` per row: everything Algorithm 1 needs (uid, reward, policy version ``P``, ``seq``) and what the
trainer needs to rebuild the entry (the handle, the row's offset and lengths, ``behaviour_logprob``, feedback, ...).
``sample`` returns EntryRefs; the trainer fetches the token buffers straight from the object store
(``store.fetch_entries``), so token bytes never pass through the actor's process.

Memory: every EntryRef of a batch shares one handle, so the batch's object is freed when the last of its rows is
evicted (and no sampled copy is still held by a trainer). FIFO and age eviction remove a batch's rows together, so
at most one batch per eviction boundary outlives its evicted rows.

No Ray, no torch, no verl imports here: the handle's ``ref`` is an opaque object (a ``ray.ObjectRef`` in practice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from claas_verl.claas.replay.entry import _LOGPROB_POSITIVE_SLACK, ReplayEntry, _is_int, _is_real


class BatchHandle:
    """The object reference of one batch's token buffer, shared by the EntryRefs of its rows.

    Fields: ``ref`` (the reference; the actor may swap it for one it owns, see ``AsyncReplayBuffer``), ``n_ids``
    (int32 ids in the buffer), ``node_id`` (the node whose object store holds it, ``None`` if unknown).
    """

    __slots__ = ("ref", "n_ids", "node_id")

    def __init__(self, ref: Any, n_ids: int, node_id: str | None = None):
        self.ref, self.n_ids, self.node_id = ref, int(n_ids), node_id

    def __getstate__(self):
        return (self.ref, self.n_ids, self.node_id)

    def __setstate__(self, state):
        self.ref, self.n_ids, self.node_id = state

    @property
    def nbytes(self) -> int:
        return 4 * self.n_ids


@dataclass(kw_only=True, eq=False)
class EntryRef:
    """A step entry whose token ids live in a batch buffer in the object store (see the module docstring).

    Same fields as :class:`ReplayEntry` except the token arrays, which are replaced by ``handle`` (the batch),
    ``offset`` (first id of the row in the batch buffer) and ``prompt_len``; ``n_tokens`` is the response length.
    Prompt ids are ``buffer[offset : offset + prompt_len]``, response ids the next ``n_tokens``.
    """

    scenario_id: int
    handle: BatchHandle
    offset: int
    prompt_len: int
    n_tokens: int
    behaviour_logprob: float
    reward: float | None
    uid: str
    step_idx: int | None = None
    feedback: str | None = None
    domain: str | None = None
    metadata: dict
    P: int | None = None
    seq: int | None = None

    def validate(self) -> None:
        """Check the metadata fields (the tokens were checked by the producer before ``put``)."""
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"uid must be a non-empty str, got {self.uid!r}")
        if not isinstance(self.handle, BatchHandle):
            raise ValueError("handle must be a BatchHandle (build EntryRefs with store.put_batch)")
        if not _is_int(self.scenario_id) or self.scenario_id < 0:
            raise ValueError(f"scenario_id must be an int >= 0, got {self.scenario_id!r}")
        if self.step_idx is not None and (not _is_int(self.step_idx) or self.step_idx < 0):
            raise ValueError(f"step_idx must be None or an int >= 0, got {self.step_idx!r}")
        for name, low in (("offset", 0), ("prompt_len", 0), ("n_tokens", 1)):
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.offset + self.prompt_len + self.n_tokens > self.handle.n_ids:
            raise ValueError(f"row [{self.offset}, +{self.prompt_len + self.n_tokens}) runs past the batch buffer's "
                             f"{self.handle.n_ids} ids")
        lp = self.behaviour_logprob
        if not _is_real(lp) or not math.isfinite(lp) or lp > _LOGPROB_POSITIVE_SLACK:
            raise ValueError(f"behaviour_logprob must be a finite sum of log-probs (<= 0), got {lp!r}")
        if self.reward is not None and (not _is_real(self.reward) or not math.isfinite(self.reward)):
            raise ValueError(f"reward must be a finite float or None (grader error), got {self.reward!r}")
        for name in ("feedback", "domain"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str or None, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(self.metadata).__name__}")
        for name in ("P", "seq"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {v!r}")

    def resolve_version(self, current_k: int) -> int:
        return current_k if self.P is None else int(self.P)

    @property
    def nbytes(self) -> int:
        """Bytes of this row's token ids (held in the object store, not by the holder of the EntryRef)."""
        return 4 * (self.prompt_len + self.n_tokens)

    def materialize(self, tokens: np.ndarray) -> ReplayEntry:
        """The full entry, with read-only views of ``tokens`` (the batch buffer this EntryRef points into)."""
        mid = self.offset + self.prompt_len
        return ReplayEntry.from_validated(
            scenario_id=self.scenario_id,
            prompt_ids=tokens[self.offset:mid],
            response_ids=tokens[mid:mid + self.n_tokens],
            behaviour_logprob=self.behaviour_logprob,
            reward=self.reward,
            uid=self.uid,
            step_idx=self.step_idx,
            n_tokens=self.n_tokens,
            feedback=self.feedback,
            domain=self.domain,
            metadata=dict(self.metadata),
            P=self.P,
            seq=self.seq,
        )


@dataclass(frozen=True, eq=False)
class RefBatch:
    """What a producer sends on the reference path: ``columns`` (a PackedEntries whose ``tokens`` is empty) and the
    ``handle`` of the token buffer, already validated and put into the object store by the producer."""

    handle: BatchHandle
    columns: Any  # PackedEntries without tokens

    def __len__(self) -> int:
        return len(self.columns)

    def to_entry_refs(self) -> list[EntryRef]:
        """Validate the columns against the handle's buffer size, then build one EntryRef per row."""
        if not isinstance(self.handle, BatchHandle):
            raise ValueError("RefBatch.handle must be a BatchHandle (build RefBatch with store.put_batch)")
        return self.columns.to_entry_refs(self.handle)
