"""Resuming a killed CLaaS run: the state saved next to verl's checkpoint, and its checks. No Ray or verl import
(torch only for the SDPO teacher files).

A CLaaS run's state is verl's checkpoint (policy, optimizer, critic: ``global_step_N/actor``, ``.../critic``, written
and loaded by verl's own ``_save_checkpoint`` / ``_load_checkpoint`` with ``trainer.resume_mode``) plus what verl
does not know about, saved by the CLaaS trainer in ``global_step_N/claas/``:

* ``replay_buffer.<time_ns>.pkl``: the replay buffer (entries, their use counts, ``k``, the sampling RNG), written
  by the ``ReplayBufferActor`` itself (atomic: temporary file, fsync, rename), named by ``state.json``;
* ``state.json`` (this module, atomic too): ``k`` (= N), the update count, the REINFORCE++ EMA reward statistics
  (b, v), the stream position (split in progress, which of its scenarios are committed, whether the split ended),
  the rows of M evaluated so far, the producer counters, the config identity (:data:`IDENTITY_KEYS`);
* ``sdpo_teacher_rank<r>.pt`` (SDPO): each training rank's EMA teacher (its local shards of the LoRA tensors).

RESTART-CONSISTENCY INVARIANT. Checkpoint N is taken at exactly one point: in the trainer thread, after update N
was applied (``on_update``: k = N) and its weights pushed, with the producers' commits paused (a commit is "add a
scenario's entries to the buffer, fold their rewards into the EMA, mark the scenario done", done atomically under
the producer's commit lock; the chat API's writes are paused and drained the same way). Hence, in every
checkpoint folder ``global_step_N``:

    verl's policy/optimizer = after N updates  ==  buffer k = N  ==  state.json global_steps = N,
    every entry in the buffer snapshot belongs to a scenario listed as done (or an earlier split), and
    the EMA statistics have seen exactly the rewards of the entries the buffer accepted up to then.

The CLaaS files are written BEFORE verl's part, and verl writes ``latest_checkpointed_iteration.txt`` last: that
tracker is the commit point. A kill before it leaves the tracker on the previous complete checkpoint; a resume
always loads one N for all pieces. What happened after checkpoint N in the killed run (updates, scenarios
committed, entries accepted; scenarios in flight) is discarded with the weights and re-done: the split's scenarios
not done at N are generated again (new entry uids), so no scenario is trained twice in the surviving history and
none is skipped. The discarded work is counted from the run's append-only trace (:func:`discarded_since`) and
logged at resume.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from claas_verl.claas.replay.snapshot import atomic_write

STATE_FORMAT = 1
CLAAS_DIR = "claas"  # inside verl's global_step_N folder
STATE_FILE = "state.json"
BUFFER_PREFIX = "replay_buffer."  # replay_buffer.<time_ns>.pkl: each capture writes a new file (see save_state)
TEACHER_FILE = "sdpo_teacher_rank{rank}.pt"

# Settings a resumed run must share with the run that wrote the checkpoint (everything that shapes the buffer, the
# stream, the estimators or the model). Others (claas.max_updates, claas.eval, claas.trace, ports, keys, concurrency)
# may change between runs.
IDENTITY_KEYS = (
    "trainer.experiment_name",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.lora_rank",
    "algorithm.adv_estimator",
    "claas.algorithm",
    "claas.m",
    "claas.b_min",
    "claas.b_max",
    "claas.a_max",
    "claas.entry_unit",
    "claas.seed",
    "claas.env.name",
    "claas.env.kwargs",
    "claas.stream",
    "claas.rpp",
    "claas.sdpo",
    "claas.producer.enabled",
    "claas.producer.max_new_tokens",
    "claas.service.enabled",
    "claas.service.reward",
)


class ResumeMismatch(ValueError):
    """A checkpoint's CLaaS state does not belong to this run (other recipe or settings, other format, torn)."""


def _lookup(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def config_identity(config: Mapping | Callable[[str], Any]) -> dict[str, Any]:
    """The :data:`IDENTITY_KEYS` of a config (a plain nested dict, or a ``select(dotted_key)`` function such as
    ``lambda k: OmegaConf.select(cfg, k)``), JSON-normalised for comparison."""
    select = config if callable(config) else (lambda key: _lookup(config, key))
    out = {k: json.loads(json.dumps(select(k), sort_keys=True, default=str)) for k in IDENTITY_KEYS}
    stream = out.get("claas.stream")
    if isinstance(stream, dict) and stream.get("split_groups") is None:
        # claas.stream.split_groups/group_key came later: at their defaults (the CLaaS paper's shuffled splits) the
        # stream is
        # the one checkpoints written before them describe, so those stay resumable
        stream.pop("split_groups", None)
        if stream.get("group_key", "families") == "families":
            stream.pop("group_key", None)
    return out


def check_identity(saved: Mapping, current: Mapping, where: str) -> None:
    """Raise :class:`ResumeMismatch` naming the first key whose value differs."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ResumeMismatch(
                f"{where} was written with {key}={saved.get(key)!r} but this run has {key}={current.get(key)!r}: "
                "resume with the recipe and overrides that wrote it, or start afresh in another "
                "trainer.default_local_dir (or with trainer.resume_mode=disable)")


@dataclass
class StreamPosition:
    """Where the scenario stream stands at a checkpoint.

    ``split``: 0-based index of the split in progress or just ended (-1: none started; service-driven runs keep -1).
    ``done``: global scenario indices of that split whose outcome is committed (entries accepted by the buffer, or
    the scenario counted as dropped / without a gradable step). ``complete``: the split's rollouts ended and its
    training ran until ``|B| < B_min`` (checkpoint j of docs/math.md §A.1.6); its row of M may still be missing.
    """

    split: int = -1
    done: list[int] = field(default_factory=list)
    complete: bool = False

    def remaining(self, split_size: int) -> list[int]:
        """Global indices of the split's scenarios still to generate (none once the split is complete)."""
        if self.split < 0 or self.complete:
            return []
        done = set(self.done)
        first = self.split * split_size
        return [i for i in range(first, first + split_size) if i not in done]


@dataclass
class ClaasState:
    """``global_step_N/claas/state.json`` (see the module docstring)."""

    global_steps: int
    updates: int
    config: dict
    position: StreamPosition
    buffer: dict  # {"file", "k", "size", "uids"}: what the snapshot holds (checked at load)
    matrix: list = field(default_factory=list)  # rows of M evaluated so far (None for an undefined cell)
    split_records: list = field(default_factory=list)
    ema: dict | None = None  # EmaRewardStats.state_dict() (REINFORCE++ b, v)
    producer: dict | None = None  # ProducerStats fields
    icl_memory: dict | None = None
    service: dict | None = None  # the chat API's counters at the checkpoint (turns pending feedback are not kept)
    sdpo_teacher: list | None = None  # teacher files, one per training rank
    tenants: dict | None = None  # a multi-tenant job: TenantTraining.save (scheduler, versions, served, EMA)
    resumes: list = field(default_factory=list)  # earlier resumes of this run's history (what each discarded)
    format: int = STATE_FORMAT

    def to_json(self) -> dict:
        out = asdict(self)
        out["matrix"] = [[None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in row]
                         for row in self.matrix]
        return out

    @classmethod
    def from_json(cls, data: Mapping, where: str) -> ClaasState:
        if not isinstance(data, Mapping) or data.get("format") != STATE_FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ResumeMismatch(f"{where}: format={got!r}, this version reads format {STATE_FORMAT}")
        fields = dict(data)
        try:
            fields["position"] = StreamPosition(**fields["position"])
            state = cls(**fields)
        except (KeyError, TypeError) as exc:
            raise ResumeMismatch(f"{where}: not a CLaaS state file ({exc})") from exc
        state.matrix = [[float("nan") if v is None else float(v) for v in row] for row in state.matrix]
        return state


def new_buffer_file() -> str:
    """A fresh name for the next buffer snapshot of a checkpoint folder."""
    return f"{BUFFER_PREFIX}{time.time_ns()}.pkl"


def save_state(claas_dir: str, state: ClaasState) -> str:
    """Atomically write ``state.json`` into ``claas_dir`` (the commit of the CLaaS part), then delete the buffer
    snapshots it no longer names; return its path.

    The snapshot is written first under a NEW name and ``state.json`` names it, so re-capturing the state of a
    checkpoint (a split end at the step of a periodic checkpoint, a service shutdown) never pairs a state.json with
    another capture's buffer: a crash before the rename keeps the previous pair, after it the new one."""
    text = json.dumps(state.to_json(), indent=1, sort_keys=True, default=str).encode()
    path = atomic_write(os.path.join(claas_dir, STATE_FILE), lambda f: f.write(text))
    for name in os.listdir(claas_dir):
        if name.startswith(BUFFER_PREFIX) and name.endswith(".pkl") and name != state.buffer["file"]:
            os.remove(os.path.join(claas_dir, name))
    return path


def load_state(claas_dir: str, identity: Mapping, global_steps: int | None = None) -> ClaasState:
    """Read and check ``claas_dir/state.json``: format, config identity (a mismatch names the key), the step it
    belongs to, and that the buffer snapshot it refers to exists. Leftover ``*.tmp`` files of an interrupted write
    are never read."""
    path = os.path.join(claas_dir, STATE_FILE)
    if not os.path.isfile(path):
        raise ResumeMismatch(
            f"{path} is missing: this checkpoint was not written by the CLaaS trainer (or predates resume support); "
            "start afresh in another trainer.default_local_dir or with trainer.resume_mode=disable")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ResumeMismatch(f"{path}: unreadable JSON ({exc})") from exc
    state = ClaasState.from_json(data, path)
    check_identity(state.config, identity, path)
    if global_steps is not None and state.global_steps != global_steps:
        raise ResumeMismatch(f"{path} holds global_steps={state.global_steps} but sits in the folder of step "
                             f"{global_steps}: the checkpoint folder was renamed or mixed")
    if state.buffer.get("k") != state.global_steps:
        raise ResumeMismatch(f"{path}: buffer k={state.buffer.get('k')} != global_steps={state.global_steps} "
                             "(a state written outside the checkpoint point)")
    if not os.path.isfile(os.path.join(claas_dir, state.buffer["file"])):
        raise ResumeMismatch(f"{path}: the buffer snapshot {state.buffer['file']} is missing in {claas_dir}")
    return state


def read_trace(path: str) -> list[dict]:
    """The records of a run's trace (JSON lines); a torn last line (the kill hit a write) is skipped."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def discarded_since(trace: Iterable[Mapping], global_steps: int) -> dict:
    """What the killed run did after checkpoint ``global_steps`` and a resume discards (counted, never re-recorded).

    The killed run is the trace's last segment (records after its last ``start``). Its commits after the
    ``claas_state`` record of this step (written while commits were paused, so it separates the commits inside the
    snapshot from those after it; the segment start when the killed run wrote none) are discarded, as are its
    updates numbered above ``global_steps``.
    """
    records = list(trace)
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    segment = records[starts[-1] + 1:] if starts else records
    ref = 0
    for i, r in enumerate(segment):
        if r.get("event") == "claas_state" and r.get("global_steps") == global_steps:
            ref = i + 1
    commits = [r for r in segment[ref:] if r.get("event") == "commit"]
    updates = [r for r in segment if r.get("event") == "update" and int(r.get("global_steps", 0)) > global_steps]
    return {
        "updates": len(updates),
        "scenarios": sorted(int(r["scenario"]) for r in commits if r.get("scenario") is not None),
        "entries_accepted": int(sum(int(r.get("accepted", 0)) for r in commits)),
    }


def tensors_sha256(named: Mapping[str, Any]) -> str:
    """sha256 over named tensors (sorted names; each name, dtype, shape and raw bytes): equal iff every tensor is equal
    byte for byte. A sharded tensor counts with its local shard (what one rank saves and restores)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name]
        t = (t.to_local() if hasattr(t, "to_local") else t).detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_teacher_state(ema: Any, probe: Mapping | None, claas_dir: str, rank: int) -> str:
    """Write an SDPO ``EmaTeacher`` (``state_dict``: τ, EMA step count, this rank's local shards) and the worker's probe
    counters to ``claas_dir/sdpo_teacher_rank<rank>.pt`` (temporary file, fsync, rename); return the path."""
    import torch

    state = {"rank": rank, "ema": ema.state_dict(), "probe": dict(probe or {})}
    return atomic_write(os.path.join(claas_dir, TEACHER_FILE.format(rank=rank)), lambda f: torch.save(state, f))


def load_teacher_state(ema: Any, claas_dir: str, rank: int) -> dict:
    """Restore what :func:`save_teacher_state` wrote for ``rank`` into ``ema`` (in place) and return the probe
    counters; a missing file, another rank's file or other tensors are refused naming the path."""
    import torch

    path = os.path.join(claas_dir, TEACHER_FILE.format(rank=rank))
    if not os.path.isfile(path):
        raise ResumeMismatch(f"{path} is missing: the checkpoint holds no SDPO teacher for training rank {rank} "
                             "(written by a non-SDPO recipe or with another number of ranks)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("rank") != rank:
        raise ResumeMismatch(f"{path}: rank={state.get('rank')!r}, expected {rank}")
    try:
        ema.load_state_dict(state["ema"])
    except ValueError as exc:
        raise ResumeMismatch(f"{path}: {exc}") from exc
    return dict(state["probe"])


def pausable_sink(sink_cls: type) -> type:
    """``sink_cls`` (the chat API's ``ActorSink``) plus ``paused()``: writes submitted while paused are queued (their
    futures resolve once they are sent after the pause, so a client waiting for ``accepted`` waits, but the chat API's
    event loop never does), those in flight are drained (their ``on_accepted`` callbacks, which feed the EMA,
    included); the service-driven checkpoint captures the buffer and the EMA inside it."""

    class PausableSink(sink_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._gate = threading.Lock()  # one pause at a time
            self._queue_lock = threading.Lock()
            self._queued: list | None = None  # a list while paused
            self._children: list = []  # the per-tenant sinks for_tenant made

        def submit(self, entries: list) -> concurrent.futures.Future:
            with self._queue_lock:
                if self._queued is not None:
                    fut: concurrent.futures.Future = concurrent.futures.Future()
                    self._queued.append((entries, fut))
                    return fut
            return super().submit(entries)

        def _send_queued(self) -> None:
            with self._queue_lock:
                queued, self._queued = self._queued or [], None
            for entries, fut in queued:
                sent = super().submit(entries)
                sent.add_done_callback(lambda s, f=fut: f.set_exception(s.exception()) if s.exception() is not None
                                       else f.set_result(s.result()))

        def for_tenant(self, tenant: str):
            """A pausable sink into ``tenant``'s partition, paused with this one (a multi-tenant chat API writes
            through one per tenant)."""
            child = super().for_tenant(tenant)
            self._children.append(child)
            return child

        @contextlib.contextmanager
        def paused(self, timeout_s: float = 60.0):
            with contextlib.ExitStack() as stack:
                for child in self._children:
                    stack.enter_context(child.paused(timeout_s))
                with self._paused_self(timeout_s):
                    yield

        @contextlib.contextmanager
        def _paused_self(self, timeout_s: float):
            with self._gate:
                with self._queue_lock:
                    self._queued = []
                try:
                    if not self.flush(timeout_s):
                        raise RuntimeError(f"chat API writes still in flight after {timeout_s}s; checkpoint not taken")
                    yield
                finally:
                    self._send_queued()

    return PausableSink
