"""Replay-buffer entries (docs/math.md §A.1.1) and the two entry units of docs/math.md §A.1.5.

Two element types can live in a :class:`~claas_verl.claas.replay.buffer.ReplayBuffer`:

- :class:`ReplayEntry`: one rollout step ``(x_{i,<=t}, y_{i,t})``; the default unit (``entry_unit="step"``).
- :class:`ScenarioEntry`: one scenario holding its T steps, each a :class:`ReplayEntry` that keeps its own
  ``behaviour_logprob`` and ``n_tokens`` (``entry_unit="scenario"``).

Token ids are stored as packed, read-only ``int32`` numpy arrays rather than Python lists: Ray pickles numpy arrays
as out-of-band buffers, which is what lets one actor ingest >10k 2,000-token entries/s (a list of ints costs a
Python object per token). Lists are accepted on construction and converted once.

No Ray, no torch, no verl imports here.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ENTRY_UNITS = ("step", "scenario")
SCENARIO_REWARD_AGGS = ("min", "mean", "last")

# Sequence log-probs are sums of log-probs and so are <= 0. A little positive slack absorbs the rounding of an
# inference server that reports per-token values in bf16/fp16; anything larger is a sign error (an NLL stored as a
# log-prob), which would silently invert every IS ratio.
_LOGPROB_POSITIVE_SLACK = 1e-3
_INT32_MAX = np.iinfo(np.int32).max


def _is_int(x: Any) -> bool:
    """True for Python/numpy integers but not for bools (a bool is almost always a bug in an id field)."""
    t = type(x)
    if t is int:  # fast path: validate() runs on every entry the actor ingests
        return True
    return t is not bool and isinstance(x, (int, np.integer)) and not isinstance(x, np.bool_)


def _is_real(x: Any) -> bool:
    t = type(x)
    if t is float or t is int:
        return True
    return t is not bool and isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, np.bool_)


def _check_shared_fields(entry: ReplayEntry | ScenarioEntry) -> None:
    """The fields a step entry and a scenario entry have in common: feedback, domain, metadata, P, seq."""
    if entry.feedback is not None and not isinstance(entry.feedback, str):
        raise ValueError(f"feedback must be a str or None, got {type(entry.feedback).__name__}")
    if entry.domain is not None and not isinstance(entry.domain, str):
        raise ValueError(f"domain must be a str or None, got {type(entry.domain).__name__}")
    if not isinstance(entry.metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(entry.metadata).__name__}")
    if entry.P is not None and (not _is_int(entry.P) or entry.P < 0):
        raise ValueError(f"P (policy version) must be None or an int >= 0, got {entry.P!r}")
    if entry.seq is not None and (not _is_int(entry.seq) or entry.seq < 0):
        raise ValueError(f"seq must be None or an int >= 0 (it is set by the buffer), got {entry.seq!r}")


def as_token_array(values: Any, field_name: str) -> np.ndarray:
    """Convert token ids to a read-only 1-D ``int32`` array, or raise ``ValueError`` naming ``field_name``.

    A read-only ``int32`` ndarray is used as is; a writable one is copied once so that freezing it never touches the
    caller's array; anything else is converted once. Ids must be in ``[0, 2^31)``.
    """
    converted = True  # True once `arr` is a fresh array nobody else holds
    if isinstance(values, np.ndarray) and values.dtype == np.int32:
        arr, converted = values, False
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError) as exc:  # ragged nested lists etc.
            raise ValueError(f"{field_name} must be a 1-D sequence of integer token ids: {exc}") from exc
        converted = arr is not values and arr.base is None  # a view of a caller's buffer is not ours
        if arr.size == 0:
            arr, converted = arr.astype(np.int32), True  # [] gives float64; [] is a valid id list
        elif not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{field_name} must hold integer token ids, got dtype {arr.dtype}; pass ints, not floats")
    if arr.ndim != 1:
        raise ValueError(f"{field_name} must be 1-D (one id per token), got shape {arr.shape}")
    if arr.size and arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _INT32_MAX:
            raise ValueError(f"{field_name} holds ids outside [0, 2^31): min {lo}, max {hi}")
        arr, converted = arr.astype(np.int32), True
    elif arr.size and int(arr.min()) < 0:
        raise ValueError(f"{field_name} holds a negative token id ({int(arr.min())}); padding must be stripped")
    if arr.flags.writeable:
        # Entries are immutable records: the buffer hands out shallow copies that share these arrays. A caller's
        # writable array is copied (8 KB for 2,000 tokens) so that freezing it never surprises the caller.
        arr = arr if converted else arr.copy()
        arr.flags.writeable = False
    return arr


@dataclass(kw_only=True, eq=False)
class ReplayEntry:
    """One replay-buffer element for one rollout step (docs/math.md §A.1.1).

    Fields (all keyword-only):
        scenario_id: id of the scenario s_i the step belongs to (int >= 0).
        prompt_ids: full chat context fed to the policy for this response, ``int32[len_prompt]``.
        response_ids: the response y including EOS, ``int32[n_tokens]``; these are exactly the tokens with m=1.
        behaviour_logprob: ℓ^b = Σ_j log π_β(y_j | prompt, y_<j), one finite scalar <= 0 per response.
        reward: finite float, or ``None`` for a grader error (docs/math.md §A.1.4: such entries are dropped by ``add``).
        uid: unique id (default: a fresh uuid4 hex). The buffer skips an entry whose uid it already holds, so a
            retried ``add`` is idempotent.
        step_idx: step t inside the scenario, ``None`` if unknown.
        n_tokens: ``len(response_ids)``; derived when omitted, checked when given.
        feedback: verifier feedback text (SDPO teacher prompt), domain: free domain tag, metadata: free dict.
        P: policy version = update count k of the weights that served the request; ``None`` -> the buffer's k at
            insertion (docs/math.md §A.1.1).
        seq: global insertion counter, set by the buffer (``None`` before insertion).

    Stored entries are shallow copies stamped with ``P`` and ``seq``; token arrays are read-only and shared.
    """

    scenario_id: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behaviour_logprob: float
    reward: float | None
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    step_idx: int | None = None
    n_tokens: int | None = None
    feedback: str | None = None
    domain: str | None = None
    metadata: dict = field(default_factory=dict)
    P: int | None = None
    seq: int | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = as_token_array(self.prompt_ids, "prompt_ids")
        self.response_ids = as_token_array(self.response_ids, "response_ids")
        if self.n_tokens is None:
            self.n_tokens = int(self.response_ids.shape[0])
        if _is_real(self.behaviour_logprob):
            self.behaviour_logprob = float(self.behaviour_logprob)
        if self.reward is not None and _is_real(self.reward):
            self.reward = float(self.reward)
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` naming the field and the fix.

        Called on construction and again by ``ReplayBuffer.add`` (a deserialised or mutated entry never ran
        ``__post_init__``), so a malformed entry can never reach the stored contents.
        """
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"uid must be a non-empty str, got {self.uid!r}")
        if not _is_int(self.scenario_id) or self.scenario_id < 0:
            raise ValueError(f"scenario_id must be an int >= 0, got {self.scenario_id!r}")
        if self.step_idx is not None and (not _is_int(self.step_idx) or self.step_idx < 0):
            raise ValueError(f"step_idx must be None or an int >= 0, got {self.step_idx!r}")
        for name in ("prompt_ids", "response_ids"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.int32 or arr.ndim != 1:
                raise ValueError(f"{name} must be a 1-D int32 array (construct the entry to convert lists)")
        if self.response_ids.shape[0] == 0:
            raise ValueError("response_ids is empty; a response has at least its EOS token")
        if not _is_int(self.n_tokens) or self.n_tokens != self.response_ids.shape[0]:
            raise ValueError(
                f"n_tokens={self.n_tokens!r} must equal len(response_ids)={self.response_ids.shape[0]} "
                "(behaviour_logprob is summed over exactly these tokens)"
            )
        if not _is_real(self.behaviour_logprob) or not math.isfinite(self.behaviour_logprob):
            raise ValueError(f"behaviour_logprob must be a finite float, got {self.behaviour_logprob!r}")
        if self.behaviour_logprob > _LOGPROB_POSITIVE_SLACK:
            raise ValueError(
                f"behaviour_logprob={self.behaviour_logprob} is positive; it must be the SUM of sampled-token "
                "log-probs (<= 0), not a negative log-likelihood"
            )
        if self.reward is not None and (not _is_real(self.reward) or not math.isfinite(self.reward)):
            raise ValueError(f"reward must be a finite float or None (grader error), got {self.reward!r}")
        _check_shared_fields(self)

    @classmethod
    def from_validated(cls, **fields: Any) -> ReplayEntry:
        """Build an entry from fields that were ALREADY checked (all of them, with the types ``__post_init__``
        produces), skipping the per-field checks. Used by ``PackedEntries.to_entries`` after its vectorised
        validation; anything else should call the constructor."""
        entry = cls.__new__(cls)
        entry.__dict__.update(fields)
        return entry

    def resolve_version(self, current_k: int) -> int:
        """P of this entry, or the buffer's current update count when the producer gave none (docs/math.md §A.1.1)."""
        return current_k if self.P is None else int(self.P)

    @property
    def nbytes(self) -> int:
        """Bytes held by the token arrays (the dominant memory cost of an entry)."""
        return int(self.prompt_ids.nbytes + self.response_ids.nbytes)


def aggregate_scenario_reward(step_rewards: Sequence[float | None], reward_agg: str = "min") -> float | None:
    """Scenario reward r_i from step grades r_{i,t} (docs/math.md §A.1.5 [CHOICE]).

    ``min`` (default; the scenario passes only if every graded turn passes), ``mean`` or ``last``.
    Any ``None`` step -> ``None`` (the whole scenario is dropped by the buffer).
    """
    if reward_agg not in SCENARIO_REWARD_AGGS:
        raise ValueError(f"reward_agg must be one of {SCENARIO_REWARD_AGGS}, got {reward_agg!r}")
    if len(step_rewards) == 0:
        raise ValueError("step_rewards is empty; a scenario has at least one step")
    if any(r is None for r in step_rewards):
        return None
    if reward_agg == "min":
        return float(min(step_rewards))
    if reward_agg == "mean":
        return float(sum(step_rewards) / len(step_rewards))
    return float(step_rewards[-1])


@dataclass(kw_only=True, eq=False)
class ScenarioEntry:
    """One replay-buffer element holding a whole scenario of T steps (docs/math.md §A.1.5, ``entry_unit="scenario"``).

    Fields:
        steps: the T :class:`ReplayEntry` steps in order; each keeps its own ``behaviour_logprob``, ``n_tokens``,
            per-step reward and (optionally) its own policy version ``P``. All share ``scenario_id``.
        reward_agg: how ``reward`` is built from the step rewards: ``min`` (default), ``mean`` or ``last``.
        reward: derived, ``None`` when any step reward is ``None`` (then ``add`` drops the scenario).
        uid, feedback, domain, metadata: as in :class:`ReplayEntry`.
        P: explicit scenario version; when ``None`` it is the minimum over the steps' versions, a step without
            one counting as the buffer's k at insertion (docs/math.md §A.1.1: "the minimum over the scenario's steps").
        seq: set by the buffer.
    """

    steps: tuple
    reward_agg: str = "min"
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    feedback: str | None = None
    domain: str | None = None
    metadata: dict = field(default_factory=dict)
    P: int | None = None
    seq: int | None = None
    reward: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if isinstance(self.steps, ReplayEntry) or not isinstance(self.steps, (list, tuple)):
            raise ValueError("steps must be a list/tuple of ReplayEntry, one per rollout step")
        self.steps = tuple(self.steps)
        self.validate()

    @property
    def scenario_id(self) -> int:
        return self.steps[0].scenario_id

    @property
    def n_tokens(self) -> int:
        """Total response tokens over all steps (the scenario loss sums the token-level objective over steps)."""
        return int(sum(s.n_tokens for s in self.steps))

    @property
    def nbytes(self) -> int:
        return int(sum(s.nbytes for s in self.steps))

    def validate(self) -> None:
        """Validate the scenario and every step; recompute ``reward`` (see :meth:`ReplayEntry.validate`)."""
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"uid must be a non-empty str, got {self.uid!r}")
        if not isinstance(self.steps, tuple) or len(self.steps) == 0:
            raise ValueError("steps must be a non-empty tuple of ReplayEntry")
        for t, step in enumerate(self.steps):
            if not isinstance(step, ReplayEntry):
                raise ValueError(f"steps[{t}] must be a ReplayEntry, got {type(step).__name__}")
            try:
                step.validate()
            except ValueError as exc:
                raise ValueError(f"steps[{t}]: {exc}") from exc
        scenario_ids = {s.scenario_id for s in self.steps}
        if len(scenario_ids) != 1:
            raise ValueError(f"steps must share one scenario_id, got {sorted(scenario_ids)}")
        step_idx = [s.step_idx for s in self.steps]
        if all(i is not None for i in step_idx) and any(b <= a for a, b in zip(step_idx, step_idx[1:])):
            raise ValueError(f"steps must be in increasing step_idx order, got {step_idx}")
        _check_shared_fields(self)
        self.reward = aggregate_scenario_reward([s.reward for s in self.steps], self.reward_agg)

    def resolve_version(self, current_k: int) -> int:
        """Explicit P, else min over the steps' versions (a step without one counts as ``current_k``)."""
        if self.P is not None:
            return int(self.P)
        return min(s.resolve_version(current_k) for s in self.steps)
