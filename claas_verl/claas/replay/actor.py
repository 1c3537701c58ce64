"""Ray actor around :class:`~claas_verl.claas.replay.buffer.ReplayBuffer` (the asynchronous CLaaS buffer).

Entries by reference (default for producers that use ``store.put_batch``): the actor receives a
:class:`~claas_verl.claas.replay.refs.RefBatch` (columns + the object reference of the batch's token buffer) and stores
EntryRefs; ``sample`` returns EntryRefs and the trainer fetches the rows from the object store itself
(``store.fetch_entries``). Token bytes never pass through this process (except to write a snapshot, which must hold
them). The buffer takes ownership of each buffer (``store.adopt_refs``, batched every ``adopt_every_s``; the reference
is swapped once the actor-owned copy exists) so an entry outlives the producer that put it; eviction drops the last
reference and the object store frees the bytes. Lists of entries and ``PackedEntries`` (the copy path) are still
accepted.

Concurrency: an *async* actor with two concurrency groups, each its own event loop on its own thread (Ray runs the
groups of an async actor that way): the default group serves producers (``add``), the ``consumer`` group the
trainer (``sample``, ``sample_when_ready``, ``wait_ready``, ``on_update`` and the cheap queries), so a sample never
queues behind inserts. Every access to the buffer holds one ``threading.Lock`` and does no I/O and no ``await`` while
holding it: that lock is the "one lock shared by the two processes" of docs/math.md §A.1.2, so each call is atomic (an
entry evicted by ``on_update`` or FIFO can never be sampled afterwards, and the ``P`` and ``k`` a sample sees belong to
one state). ``wait_ready`` parks on a future that ``add`` resolves thread-safely, so waiting costs nothing.

Tenants: with ``partitions`` (``{tenant: {b_min, b_max, a_max}}``) the actor keeps one buffer per tenant
(:mod:`claas_verl.claas.replay.partitions`): every buffer call takes ``tenant=`` and touches that tenant's partition
only (its own FIFO, age clock ``k`` counted in its own updates, RNG); ``ready_tenants``/``wait_any_ready`` tell the
trainer's scheduler which tenants can be updated. Without ``partitions`` there is one implicit partition and
``tenant`` may be left out: the single-tenant API is unchanged.

Restarts: build the actor with :func:`make_replay_actor` (or ``ReplayBufferActor.options(max_restarts=...)``). When
``snapshot_path`` is given, the constructor loads the snapshot if the file exists, so an actor restarted by Ray
(same constructor arguments) resumes from its last snapshot; ``snapshot_every_s`` adds periodic snapshots (taken
only when something changed). Snapshots are written atomically (see ``snapshot.py``) in a worker thread, from a
state captured under the lock, with the tokens of entries held by reference fetched from the object store, so adds
and samples keep flowing while the file is written. Restored entries are held by copy.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings

import ray

from claas_verl.claas.replay.partitions import PartitionedReplay
from claas_verl.claas.replay.refs import RefBatch
from claas_verl.claas.replay.snapshot import load_snapshot, save_snapshot

CONSUMER_GROUP = "consumer"
_ANY = object()  # a waiter for any tenant's readiness (wait_any_ready)
_CONSUMER_CONCURRENCY = 16  # concurrent consumer calls (parked waiters count); the trainer makes one at a time


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(True)


class AsyncReplayBuffer:
    """The actor body, usable on its own inside one asyncio program (tests, an in-process service).

    Arguments as in :class:`ReplayBuffer` plus ``snapshot_path`` (file to resume from at construction and to save
    to by default), ``snapshot_every_s`` (periodic saves), ``adopt`` (take ownership of the object-store buffers of
    entries held by reference; only when Ray is initialised) and ``adopt_every_s`` (how long a new buffer may stay
    owned by its producer), and ``partitions`` (one buffer per tenant, instead of ``b_max``/``b_min``/``a_max``). As a
    Ray actor, build it with :func:`make_replay_actor` or ``ReplayBufferActor.options(...).remote(...)``.
    """

    def __init__(
        self,
        b_max: int | None = None,
        b_min: int | None = None,
        a_max: int | None = None,
        seed: int | None = None,
        entry_unit: str = "step",
        snapshot_path: str | None = None,
        snapshot_every_s: float | None = None,
        adopt: bool = True,
        adopt_every_s: float = 0.05,
        partitions: dict | None = None,
    ):
        if snapshot_every_s is not None and (snapshot_path is None or not snapshot_every_s > 0):
            raise ValueError("snapshot_every_s needs a snapshot_path and must be > 0")
        if not adopt_every_s > 0:
            raise ValueError(f"adopt_every_s must be > 0, got {adopt_every_s!r}")
        self._replay = PartitionedReplay(b_max, b_min, a_max, seed, entry_unit, partitions)
        self._lock = threading.Lock()  # guards _replay and the bookkeeping below; never held across an await
        self._snapshot_path = snapshot_path
        self._snapshot_every_s = snapshot_every_s
        self._restored = False
        if snapshot_path is not None and os.path.exists(snapshot_path):
            self._replay.load_state_dict(load_snapshot(snapshot_path))
            self._restored = True
        # parked wait_ready / wait_any_ready calls: (loop, future, tenant or _ANY)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, object]] = []
        self._save_lock = threading.Lock()  # one writer at a time, so an older state never replaces a newer one
        self._changes = 0  # bumped by every mutation; periodic snapshots skip when unchanged
        self._saved_changes = 0
        self._snapshots_written = 0
        self._snapshot_errors = 0
        self._last_snapshot_error: str | None = None
        self._snapshot_task: asyncio.Task | None = None
        self._adopt = bool(adopt)
        self._adopt_every_s = float(adopt_every_s)
        self._to_adopt: list = []  # handles still owned by their producer
        self._adopt_scheduled = False
        self._adoptions: set[asyncio.Task] = set()  # adoption rounds in flight
        self._adopted_batches = 0
        self._adopt_errors = 0
        self._last_adopt_error: str | None = None

    # ------------------------------------------------------------------ helpers
    def _start_background(self) -> None:
        # The event loop exists only once methods run, so the periodic task is started lazily.
        if self._snapshot_every_s is not None and self._snapshot_task is None:
            with self._lock:
                if self._snapshot_task is not None:
                    return
                self._snapshot_task = asyncio.get_running_loop().create_task(self._snapshot_loop())

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self._snapshot_every_s)
            if self._changes != self._saved_changes:
                try:
                    await self.save()
                except Exception as exc:  # a full disk must not kill the loop; the next period retries
                    self._snapshot_errors += 1
                    self._last_snapshot_error = repr(exc)

    def _wake_waiters_locked(self) -> None:
        """Resolve every parked waiter whose tenant (or, for ``wait_any_ready``, any tenant) is ready, each on its
        own loop, thread-safely. Call with the lock held."""
        if not self._waiters:
            return
        ready = set(self._replay.ready_tenants())
        if not ready:
            return
        keep = []
        for loop, fut, tenant in self._waiters:
            if tenant is _ANY or self._replay.part(tenant).ready():
                loop.call_soon_threadsafe(_resolve, fut)
            else:
                keep.append((loop, fut, tenant))
        self._waiters = keep

    def _adopt_pending(self) -> None:
        with self._lock:
            handles, self._to_adopt, self._adopt_scheduled = self._to_adopt, [], False
        if not handles:
            return
        from claas_verl.claas.replay.store import adopt_refs

        try:
            pending = adopt_refs(handles)  # submits one adopter call per node; no waiting here
        except Exception as exc:  # the producer-owned refs stay valid while their producers live
            self._adopt_errors += 1
            self._last_adopt_error = repr(exc)
            return
        task = asyncio.get_running_loop().create_task(self._finish_adoption(pending))
        self._adoptions.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._adoptions.discard)

    async def _finish_adoption(self, pending) -> None:
        """Wait for each adopter call, then swap the handles to the actor-owned copies (readers never wait for an
        adoption in flight; a failed call leaves the producer-owned refs in place, counted).

        Awaited on the event loop, not waited for in a worker thread: a thread blocked in ``ray.get`` on a call that
        never completes (its cluster shut down under it) kept the actor's process from exiting, spinning a core."""
        for group, new_refs, marker in pending:
            try:
                await marker
            except Exception as exc:
                with self._lock:
                    self._adopt_errors += 1
                    self._last_adopt_error = repr(exc)
                continue
            with self._lock:
                for h, ref in zip(group, new_refs):
                    h.ref = ref  # the producer's copy is freed once no reader holds it
                self._adopted_batches += len(group)

    # ------------------------------------------------------------------ buffer API
    async def add(self, entries, tenant: str | None = None) -> int:
        """``ReplayBuffer.add`` into ``tenant``'s partition: all-or-nothing validation, returns the number accepted.
        A :class:`~claas_verl.claas.replay.refs.RefBatch` is stored by reference."""
        self._start_background()
        with self._lock:
            accepted = self._replay.part(tenant).add(entries)
            self._changes += 1
            self._wake_waiters_locked()
            schedule = False
            if accepted and isinstance(entries, RefBatch) and self._adopt and ray.is_initialized():
                self._to_adopt.append(entries.handle)
                schedule, self._adopt_scheduled = not self._adopt_scheduled, True
        if schedule:
            asyncio.get_running_loop().call_later(self._adopt_every_s, self._adopt_pending)
        return accepted

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def sample(self, m: int, tenant: str | None = None) -> list:
        """``ReplayBuffer.sample`` of ``tenant``'s partition: ``m`` distinct entries of that tenant only, uniform;
        ``ValueError`` when not ready. Entries held by
        reference come back as EntryRefs (``store.fetch_entries`` turns them into entries)."""
        self._start_background()
        with self._lock:
            out = self._replay.part(tenant).sample(m)
            self._changes += 1
        return out

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def wait_ready(self, timeout_s: float | None = None, tenant: str | None = None) -> bool:
        """Block (without polling) until ``tenant``'s partition holds ``b_min`` entries or ``timeout_s`` passes;
        return its ``ready()``."""
        self._start_background()
        with self._lock:
            part = self._replay.part(tenant)  # an unknown tenant raises before parking
        await self._park(timeout_s, tenant, part.ready)
        with self._lock:
            return part.ready()

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def wait_any_ready(self, timeout_s: float | None = None) -> list[str]:
        """Block until at least one tenant's partition is ready or ``timeout_s`` passes; return the ready tenants
        (in partition order; empty on timeout)."""
        self._start_background()
        await self._park(timeout_s, _ANY, lambda: bool(self._replay.ready_tenants()))
        with self._lock:
            return self._replay.ready_tenants()

    async def _park(self, timeout_s: float | None, tenant, is_ready) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if is_ready():
                return
            self._waiters.append((loop, fut, tenant))
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            pass
        with self._lock:
            self._waiters = [w for w in self._waiters if w[1] is not fut]

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def sample_when_ready(self, m: int, timeout_s: float | None = None,
                                tenant: str | None = None) -> list | None:
        """Wait for readiness then sample under the same lock acquisition that checks it (an ``on_update`` in
        between cannot make it sample an unready buffer); ``None`` on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            if not await self.wait_ready(left, tenant):
                return None
            with self._lock:
                part = self._replay.part(tenant)
                if part.ready():
                    out = part.sample(m)
                    self._changes += 1
                    return out

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def on_update(self, tenant: str | None = None) -> int:
        """``ReplayBuffer.on_update`` of ``tenant``'s partition (its ``k += 1`` and its age eviction; no other
        tenant's clock moves); returns the number evicted (evicted entries held
        by reference drop their object-store buffers once no batch row and no sampled copy refers to them)."""
        self._start_background()
        with self._lock:
            evicted = self._replay.part(tenant).on_update()
            self._changes += 1
        return evicted

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def ready(self, tenant: str | None = None) -> bool:
        with self._lock:
            return self._replay.part(tenant).ready()

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def ready_tenants(self) -> list[str]:
        """Tenants whose partition holds at least its ``b_min`` entries (partition order)."""
        with self._lock:
            return self._replay.ready_tenants()

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def tenants(self) -> list[str]:
        """The partitions' tenant names (``["default"]`` for the implicit one)."""
        return list(self._replay.names)

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def size(self, tenant: str | None = None) -> int:
        with self._lock:
            return len(self._replay.part(tenant))

    @ray.method(concurrency_group=CONSUMER_GROUP)
    async def update_count(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._replay.part(tenant).update_count

    async def entries(self, tenant: str | None = None) -> list:
        """Stored entries of ``tenant`` in insertion order (EntryRefs for those held by reference)."""
        with self._lock:
            return self._replay.part(tenant).entries()

    async def summary(self, tenant: str | None = None) -> dict:
        """``k``, size and the stored uids of ``tenant`` in insertion order, from one state (what a checkpoint
        records)."""
        with self._lock:
            part = self._replay.part(tenant)
            return {"k": part.update_count, "size": len(part), "uids": [e.uid for e in part.entries()]}

    async def stats(self, tenant: str | None = None) -> dict:
        """``ReplayBuffer.stats`` of ``tenant``'s partition plus snapshot and reference bookkeeping
        (``stored_nbytes`` counts the token bytes of the stored rows, wherever they live; ``ref_batches`` the
        object-store buffers the buffer refers to). A partitioned actor asked without a tenant answers the
        bookkeeping, ``size`` summed over tenants and ``tenants``: each partition's stats."""
        with self._lock:
            if tenant is None and not self._replay.implicit:
                per = {n: b.stats() for n, b in self._replay.items()}
                stats = {"size": self._replay.total_size(), "tenants": per}
            else:
                stats = self._replay.part(tenant).stats()
            ref_batches = sum(len(b.batch_handles()) for _, b in self._replay.items())
        return {
            **stats,
            "ref_batches": ref_batches,
            "adopted_batches": self._adopted_batches,
            "adopt_errors": self._adopt_errors,
            "last_adopt_error": self._last_adopt_error,
            "restored_from_snapshot": self._restored,
            "snapshots_written": self._snapshots_written,
            "snapshot_errors": self._snapshot_errors,
            "last_snapshot_error": self._last_snapshot_error,
        }

    async def state_dict(self) -> dict:
        """The buffer's state (every partition's); entries held by reference stay EntryRefs (``save`` writes full
        entries)."""
        with self._lock:
            return self._replay.state_dict()

    async def close(self) -> None:
        """Stop periodic snapshots (standalone use: call before the event loop ends)."""
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            self._snapshot_task = None

    # ------------------------------------------------------------------ persistence
    def _save_blocking(self, path: str) -> str:
        from claas_verl.claas.replay.store import materialize_state

        with self._save_lock:
            with self._lock:
                state, changes = self._replay.state_dict(), self._changes  # captured atomically
            # tokens fetched outside the lock
            written = save_snapshot(path, self._replay.map_states(state, materialize_state))
            with self._lock:
                if path == self._snapshot_path:
                    self._saved_changes = max(self._saved_changes, changes)
                self._snapshots_written += 1
        return written

    async def save(self, path: str | None = None) -> str:
        """Atomically write a snapshot to ``path`` (default: ``snapshot_path``); return the path written. Entries
        held by reference are written with their tokens."""
        path = path or self._snapshot_path
        if path is None:
            raise ValueError("save needs a path (or construct the actor with snapshot_path)")
        return await asyncio.get_running_loop().run_in_executor(None, self._save_blocking, path)

    async def load(self, path: str) -> None:
        """Replace the contents with the snapshot at ``path`` (config must match; unchanged on error)."""
        state = await asyncio.get_running_loop().run_in_executor(None, load_snapshot, path)
        with self._lock:
            self._replay.load_state_dict(state)
            self._changes += 1
            self._wake_waiters_locked()


# The Ray actor class. num_cpus=0: the buffer is I/O-bound bookkeeping and must not hold a CPU slot that a rollout
# or training worker needs. Restarts are off here; make_replay_actor turns them on.
ReplayBufferActor = ray.remote(
    num_cpus=0, max_restarts=0, concurrency_groups={CONSUMER_GROUP: _CONSUMER_CONCURRENCY}
)(AsyncReplayBuffer)


def make_replay_actor(
    b_max: int | None = None,
    b_min: int | None = None,
    a_max: int | None = None,
    *,
    seed: int | None = None,
    entry_unit: str = "step",
    snapshot_path: str | None = None,
    snapshot_every_s: float | None = None,
    adopt: bool = True,
    max_restarts: int = -1,
    max_task_retries: int = 0,
    name: str | None = None,
    namespace: str | None = None,
    lifetime: str | None = None,
    partitions: dict | None = None,
):
    """Create a :data:`ReplayBufferActor` handle.

    ``max_restarts=-1`` restarts forever; with ``snapshot_path`` a restarted actor resumes from its last snapshot
    (anything added after it is lost, so pair restarts with ``snapshot_every_s``). ``max_task_retries`` defaults to
    0 because ``sample``/``on_update`` are not idempotent; ``add`` is (duplicate uids are skipped), so a producer
    may safely retry it itself. Arguments are validated here, in the caller, so mistakes raise ``ValueError``
    immediately rather than as a Ray actor-creation failure.
    """
    PartitionedReplay(b_max, b_min, a_max, seed, entry_unit, partitions)  # validate sizes eagerly
    if snapshot_every_s is not None and (snapshot_path is None or not snapshot_every_s > 0):
        raise ValueError("snapshot_every_s needs a snapshot_path and must be > 0")
    if max_restarts != 0 and snapshot_path is None:
        warnings.warn(
            "make_replay_actor: restarts are enabled but snapshot_path is None, so a restarted buffer starts empty",
            UserWarning,
            stacklevel=2,
        )
    options = {"max_restarts": max_restarts, "max_task_retries": max_task_retries}
    if name is not None:
        options["name"] = name
    if namespace is not None:
        options["namespace"] = namespace
    if lifetime is not None:
        options["lifetime"] = lifetime
    return ReplayBufferActor.options(**options).remote(
        b_max,
        b_min,
        a_max,
        seed=seed,
        entry_unit=entry_unit,
        snapshot_path=os.path.abspath(snapshot_path) if snapshot_path else None,
        snapshot_every_s=snapshot_every_s,
        adopt=adopt,
        partitions=None if partitions is None else {n: dict(s) for n, s in partitions.items()},
    )
