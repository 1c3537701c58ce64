"""Columnar batches of step entries: the wire format between rollout producers and the replay actor.

A list of 50 :class:`~claas_verl.claas.replay.entry.ReplayEntry` objects crosses a Ray call as 100 small arrays and 50
objects, and the actor then re-validates every entry field by field. :class:`PackedEntries` carries the same batch
as ONE ``int32`` token buffer plus a few numeric columns, so serialisation is a handful of out-of-band buffers and
validation is a few vectorised checks. ``ReplayBuffer.add`` (and therefore the actor's ``add``) accepts it wherever
it accepts a list of step entries; ``PackedEntries.from_entries`` builds one on the producer side.

Layout of entry ``i`` (``n`` entries)::

    tokens[start_i : start_i + prompt_lens[i]]                      prompt ids
    tokens[start_i + prompt_lens[i] : start_i + p_i + response_lens[i]]  response ids
    start_i = sum_{j<i} (prompt_lens[j] + response_lens[j])

``None`` in an optional integer column (``step_idx``, ``P``) is ``-1``; a missing reward (grader error, dropped by
the buffer) is ``has_reward[i] = False``.

The entries that :meth:`PackedEntries.to_entries` returns hold read-only VIEWS of one private copy of ``tokens``
(the copy detaches them from the Ray object store, whose memory would otherwise stay pinned). The copy is freed
when the last entry of the batch is evicted; FIFO and age eviction remove a batch's entries together, so at most
one batch per eviction boundary outlives its evicted part.

On the reference path (``store.put_batch``) the producer validates the whole batch, puts ``tokens`` into Ray's object
store and sends the columns without their tokens (:meth:`PackedEntries.without_tokens`); the actor builds EntryRefs
from them (:meth:`PackedEntries.to_entry_refs`), checking every column but never reading a token.

No Ray, no torch, no verl imports here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from claas_verl.claas.replay.entry import _LOGPROB_POSITIVE_SLACK, ReplayEntry

_INT_COLUMNS = ("prompt_lens", "response_lens", "scenario_id", "step_idx", "P")
_FLOAT_COLUMNS = ("behaviour_logprob", "reward")
_OBJECT_COLUMNS = ("uid", "feedback", "domain", "metadata")


@dataclass(frozen=True, eq=False)
class PackedEntries:
    """``n`` step entries in columns (see the module docstring for the token layout).

    Fields:
        tokens: ``int32[sum(prompt_lens + response_lens)]``, prompt then response ids of each entry, in order.
        prompt_lens, response_lens: ``int64[n]``; ``response_lens >= 1`` (a response holds at least its EOS).
        behaviour_logprob: ``float64[n]``, ℓ^b per response (finite, <= 0).
        reward: ``float64[n]``; read only where ``has_reward``.
        has_reward: ``bool[n]``; False = grader error (the buffer drops the entry and counts it).
        scenario_id: ``int64[n] >= 0``; step_idx, P: ``int64[n]``, ``-1`` for None.
        uid, feedback, domain, metadata: tuples of length ``n`` (str; str|None; str|None; dict).
    """

    tokens: np.ndarray
    prompt_lens: np.ndarray
    response_lens: np.ndarray
    behaviour_logprob: np.ndarray
    reward: np.ndarray
    has_reward: np.ndarray
    scenario_id: np.ndarray
    step_idx: np.ndarray
    P: np.ndarray
    uid: tuple
    feedback: tuple
    domain: tuple
    metadata: tuple

    # ------------------------------------------------------------------ producer side
    @classmethod
    def from_entries(cls, entries: Sequence[ReplayEntry]) -> PackedEntries:
        """Pack validated entries (one concatenation of their token arrays)."""
        entries = list(entries)
        for i, e in enumerate(entries):
            if not isinstance(e, ReplayEntry):
                raise ValueError(f"entries[{i}] is a {type(e).__name__}; PackedEntries packs ReplayEntry steps")
        parts = [a for e in entries for a in (e.prompt_ids, e.response_ids)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)

        def opt(values):
            return np.array([-1 if v is None else v for v in values], dtype=np.int64)

        return cls(
            tokens=tokens.astype(np.int32, copy=False),
            prompt_lens=np.array([len(e.prompt_ids) for e in entries], dtype=np.int64),
            response_lens=np.array([len(e.response_ids) for e in entries], dtype=np.int64),
            behaviour_logprob=np.array([e.behaviour_logprob for e in entries], dtype=np.float64),
            reward=np.array([np.nan if e.reward is None else e.reward for e in entries], dtype=np.float64),
            has_reward=np.array([e.reward is not None for e in entries], dtype=bool),
            scenario_id=np.array([e.scenario_id for e in entries], dtype=np.int64),
            step_idx=opt(e.step_idx for e in entries),
            P=opt(e.P for e in entries),
            uid=tuple(e.uid for e in entries),
            feedback=tuple(e.feedback for e in entries),
            domain=tuple(e.domain for e in entries),
            metadata=tuple(e.metadata for e in entries),
        )

    def __len__(self) -> int:
        return len(self.uid)

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes)

    # ------------------------------------------------------------------ consumer side
    def validate(self, token_count: int | None = None) -> None:
        """Vectorised checks of every column; ``ValueError`` naming ``entries[i].<field>`` and the fix.

        ``token_count``: the batch's tokens live elsewhere (the reference path: ``tokens`` is empty and the buffer,
        checked by the producer before it was put into the object store, holds ``token_count`` ids); the lengths
        are checked against it and the token contents are not checked here.
        """
        if not isinstance(self.prompt_lens, np.ndarray) or self.prompt_lens.ndim != 1:
            raise ValueError("prompt_lens must be a 1-D array with one length per entry")
        n = self.prompt_lens.shape[0]  # every other column must agree with it
        for name in _OBJECT_COLUMNS:
            col = getattr(self, name)
            if not isinstance(col, tuple) or len(col) != n:
                got = f"a {type(col).__name__} of length {len(col)}" if hasattr(col, "__len__") else type(col).__name__
                raise ValueError(f"{name} must be a tuple of {n} values (one per entry), got {got}")
        for name in (*_INT_COLUMNS, *_FLOAT_COLUMNS, "has_reward"):
            col = getattr(self, name)
            if not isinstance(col, np.ndarray) or col.shape != (n,):
                shape = getattr(col, "shape", type(col).__name__)
                raise ValueError(f"{name} must be a 1-D array of {n} values (one per entry), got {shape}")
        for name in _INT_COLUMNS:
            if not np.issubdtype(getattr(self, name).dtype, np.integer):
                raise ValueError(f"{name} must hold integers, got dtype {getattr(self, name).dtype}")
        if self.has_reward.dtype != bool:
            raise ValueError(f"has_reward must be a bool array, got dtype {self.has_reward.dtype}")
        if token_count is None and (
            not isinstance(self.tokens, np.ndarray) or self.tokens.dtype != np.int32 or self.tokens.ndim != 1
        ):
            raise ValueError("tokens must be a 1-D int32 array (build batches with PackedEntries.from_entries)")

        def first_bad(mask: np.ndarray, field: str, why: str) -> None:
            if mask.any():
                i = int(np.flatnonzero(mask)[0])
                raise ValueError(f"entries[{i}] (uid={self.uid[i]!r}): {field} {why}")

        first_bad(self.prompt_lens < 0, "prompt_ids", "has a negative length")
        first_bad(self.response_lens < 1, "response_ids", "is empty; a response has at least its EOS token")
        total = int(self.prompt_lens.sum() + self.response_lens.sum())
        held = self.tokens.shape[0] if token_count is None else int(token_count)
        if total != held:
            raise ValueError(f"tokens holds {held} ids but the lengths add up to {total}")
        if token_count is None and total and int(self.tokens.min()) < 0:
            ends = np.cumsum(self.prompt_lens + self.response_lens)
            i = int(np.searchsorted(ends, int(np.flatnonzero(self.tokens < 0)[0]), side="right"))
            raise ValueError(f"entries[{i}] (uid={self.uid[i]!r}): token ids must be >= 0; strip padding")
        lp = self.behaviour_logprob
        first_bad(~np.isfinite(lp), "behaviour_logprob", "must be finite")
        first_bad(lp > _LOGPROB_POSITIVE_SLACK, "behaviour_logprob",
                  "is positive; it must be the SUM of sampled-token log-probs (<= 0), not an NLL")
        first_bad(self.has_reward & ~np.isfinite(self.reward), "reward",
                  "must be finite (set has_reward False for a grader error)")
        first_bad(self.scenario_id < 0, "scenario_id", "must be >= 0")
        first_bad(self.step_idx < -1, "step_idx", "must be >= 0 (or -1 for None)")
        first_bad(self.P < -1, "P (policy version)", "must be >= 0 (or -1 for None)")
        for i, (uid, fb, dom, meta) in enumerate(zip(self.uid, self.feedback, self.domain, self.metadata)):
            if type(uid) is not str or not uid:
                raise ValueError(f"entries[{i}]: uid must be a non-empty str, got {uid!r}")
            if fb is not None and type(fb) is not str:
                raise ValueError(f"entries[{i}] (uid={uid!r}): feedback must be a str or None")
            if dom is not None and type(dom) is not str:
                raise ValueError(f"entries[{i}] (uid={uid!r}): domain must be a str or None")
            if type(meta) is not dict:
                raise ValueError(f"entries[{i}] (uid={uid!r}): metadata must be a dict")

    def to_entries(self) -> list[ReplayEntry]:
        """Validate, then build the entries over read-only views of one private copy of ``tokens``."""
        self.validate()
        tokens = np.array(self.tokens, dtype=np.int32, copy=True)
        tokens.flags.writeable = False
        ends = np.cumsum(self.prompt_lens + self.response_lens).tolist()
        plens = self.prompt_lens.tolist()
        rlens = self.response_lens.tolist()
        lps = self.behaviour_logprob.tolist()
        rewards = self.reward.tolist()
        has = self.has_reward.tolist()
        sids = self.scenario_id.tolist()
        steps = self.step_idx.tolist()
        versions = self.P.tolist()
        out = []
        start = 0
        for i, end in enumerate(ends):
            mid = start + plens[i]
            out.append(ReplayEntry.from_validated(
                scenario_id=sids[i],
                prompt_ids=tokens[start:mid],
                response_ids=tokens[mid:end],
                behaviour_logprob=lps[i],
                reward=rewards[i] if has[i] else None,
                uid=self.uid[i],
                step_idx=None if steps[i] < 0 else steps[i],
                n_tokens=rlens[i],
                feedback=self.feedback[i],
                domain=self.domain[i],
                metadata=dict(self.metadata[i]),
                P=None if versions[i] < 0 else versions[i],
                seq=None,
            ))
            start = end
        return out


    def without_tokens(self) -> PackedEntries:
        """The same columns with an empty token buffer (the header a producer sends on the reference path)."""
        return dataclasses.replace(self, tokens=_NO_TOKENS)

    def to_entry_refs(self, handle) -> list:
        """Validate the columns against ``handle.n_ids`` and build one :class:`~claas_verl.claas.replay.refs.EntryRef`
        per row, all sharing ``handle`` (the reference path: no token is read or copied)."""
        from claas_verl.claas.replay.refs import EntryRef

        self.validate(token_count=handle.n_ids)
        starts = np.concatenate([[0], np.cumsum(self.prompt_lens + self.response_lens)[:-1]]).tolist()
        plens, rlens = self.prompt_lens.tolist(), self.response_lens.tolist()
        lps, rewards, has = self.behaviour_logprob.tolist(), self.reward.tolist(), self.has_reward.tolist()
        sids, steps, versions = self.scenario_id.tolist(), self.step_idx.tolist(), self.P.tolist()
        out = []
        for i, start in enumerate(starts[: len(plens)]):
            ref = EntryRef.__new__(EntryRef)  # fields validated column-wise above
            ref.__dict__.update(
                scenario_id=sids[i], handle=handle, offset=start, prompt_len=plens[i], n_tokens=rlens[i],
                behaviour_logprob=lps[i], reward=rewards[i] if has[i] else None, uid=self.uid[i],
                step_idx=None if steps[i] < 0 else steps[i], feedback=self.feedback[i], domain=self.domain[i],
                metadata=dict(self.metadata[i]), P=None if versions[i] < 0 else versions[i], seq=None,
            )
            out.append(ref)
        return out


_NO_TOKENS = np.zeros(0, np.int32)
_NO_TOKENS.flags.writeable = False


def wire_format(entries: Sequence) -> PackedEntries | list:
    """What a producer should send to the replay actor: a :class:`PackedEntries` when every item is a step entry
    (cheaper to ship and to validate), else the list unchanged (scenario entries, or an empty batch)."""
    entries = list(entries)
    if entries and all(type(e) is ReplayEntry for e in entries):
        return PackedEntries.from_entries(entries)
    return entries
