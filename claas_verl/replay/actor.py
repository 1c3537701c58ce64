"""Ray actor around :class:`~claas_verl.replay.buffer.ReplayBuffer` (the asynchronous CLaaS buffer).

Concurrency: this is an *async* actor. Every method runs on the actor's single event loop and touches the buffer
without an ``await`` in between, so each call is atomic; that loop is the "one lock shared by the two processes" of
SPEC A.1.2, and any number of producers and samplers may call concurrently. ``wait_ready`` parks on an
``asyncio.Condition`` that ``add`` notifies, so waiting costs nothing and never blocks other calls.

Restarts: build the actor with :func:`make_replay_actor` (or ``ReplayBufferActor.options(max_restarts=...)``). When
``snapshot_path`` is given, the constructor loads the snapshot if the file exists, so an actor restarted by Ray
(same constructor arguments) resumes from its last snapshot; ``snapshot_every_s`` adds periodic snapshots (taken
only when something changed). Snapshots are written atomically (see ``snapshot.py``) in a worker thread from a
state captured synchronously, so adds and samples keep flowing while the file is written.
"""

from __future__ import annotations

import asyncio
import os
import warnings

import ray

from claas_verl.replay.buffer import ReplayBuffer
from claas_verl.replay.snapshot import load_snapshot, save_snapshot


class AsyncReplayBuffer:
    """The actor body, usable on its own inside one asyncio program (tests, an in-process service).

    Arguments as in :class:`ReplayBuffer` plus ``snapshot_path`` (file to resume from at construction and to save
    to by default) and ``snapshot_every_s`` (periodic saves). As a Ray actor, build it with
    :func:`make_replay_actor` or ``ReplayBufferActor.options(...).remote(...)``.
    """

    def __init__(
        self,
        b_max: int,
        b_min: int,
        a_max: int,
        seed: int | None = None,
        entry_unit: str = "step",
        snapshot_path: str | None = None,
        snapshot_every_s: float | None = None,
    ):
        if snapshot_every_s is not None and (snapshot_path is None or not snapshot_every_s > 0):
            raise ValueError("snapshot_every_s needs a snapshot_path and must be > 0")
        self._buffer = ReplayBuffer(b_max, b_min, a_max, seed, entry_unit=entry_unit)
        self._snapshot_path = snapshot_path
        self._snapshot_every_s = snapshot_every_s
        self._restored = False
        if snapshot_path is not None and os.path.exists(snapshot_path):
            self._buffer.load_state_dict(load_snapshot(snapshot_path))
            self._restored = True
        self._ready_cond = asyncio.Condition()
        self._save_lock = asyncio.Lock()  # one writer at a time, so an older state never replaces a newer one
        self._changes = 0  # bumped by every mutation; periodic snapshots skip when unchanged
        self._saved_changes = 0
        self._snapshots_written = 0
        self._snapshot_errors = 0
        self._last_snapshot_error: str | None = None
        self._snapshot_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ helpers
    def _start_background(self) -> None:
        # The event loop exists only once methods run, so the periodic task is started lazily.
        if self._snapshot_every_s is not None and self._snapshot_task is None:
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

    async def _notify_if_ready(self) -> None:
        if self._buffer.ready():
            async with self._ready_cond:
                self._ready_cond.notify_all()

    # ------------------------------------------------------------------ buffer API
    async def add(self, entries) -> int:
        """``ReplayBuffer.add``: all-or-nothing validation, returns the number accepted."""
        self._start_background()
        accepted = self._buffer.add(entries)
        self._changes += 1
        await self._notify_if_ready()
        return accepted

    async def sample(self, m: int) -> list:
        """``ReplayBuffer.sample``: ``m`` distinct entries, uniform; ``ValueError`` when not ready."""
        self._start_background()
        out = self._buffer.sample(m)
        self._changes += 1
        return out

    async def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block (without polling) until ``len >= b_min`` or ``timeout_s`` passes; return ``ready()``."""
        self._start_background()
        if self._buffer.ready():
            return True
        try:
            async with self._ready_cond:
                await asyncio.wait_for(self._ready_cond.wait_for(self._buffer.ready), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self._buffer.ready()

    async def sample_when_ready(self, m: int, timeout_s: float | None = None) -> list | None:
        """Wait for readiness then sample in the same atomic step (no other call can drain the buffer in
        between); ``None`` on timeout."""
        if not await self.wait_ready(timeout_s):
            return None
        return await self.sample(m)

    async def on_update(self) -> int:
        """``ReplayBuffer.on_update``: ``k += 1``, age eviction; returns the number evicted."""
        self._start_background()
        evicted = self._buffer.on_update()
        self._changes += 1
        return evicted

    async def ready(self) -> bool:
        return self._buffer.ready()

    async def size(self) -> int:
        return len(self._buffer)

    async def update_count(self) -> int:
        return self._buffer.update_count

    async def entries(self) -> list:
        return self._buffer.entries()

    async def stats(self) -> dict:
        """``ReplayBuffer.stats`` plus snapshot bookkeeping."""
        return {
            **self._buffer.stats(),
            "restored_from_snapshot": self._restored,
            "snapshots_written": self._snapshots_written,
            "snapshot_errors": self._snapshot_errors,
            "last_snapshot_error": self._last_snapshot_error,
        }

    async def state_dict(self) -> dict:
        return self._buffer.state_dict()

    async def close(self) -> None:
        """Stop periodic snapshots (standalone use: call before the event loop ends)."""
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            self._snapshot_task = None

    # ------------------------------------------------------------------ persistence
    async def save(self, path: str | None = None) -> str:
        """Atomically write a snapshot to ``path`` (default: ``snapshot_path``); return the path written."""
        path = path or self._snapshot_path
        if path is None:
            raise ValueError("save needs a path (or construct the actor with snapshot_path)")
        async with self._save_lock:
            state, changes = self._buffer.state_dict(), self._changes  # captured atomically on the loop
            written = await asyncio.get_running_loop().run_in_executor(None, save_snapshot, path, state)
            if path == self._snapshot_path:
                self._saved_changes = changes
            self._snapshots_written += 1
        return written

    async def load(self, path: str) -> None:
        """Replace the contents with the snapshot at ``path`` (config must match; unchanged on error)."""
        state = await asyncio.get_running_loop().run_in_executor(None, load_snapshot, path)
        self._buffer.load_state_dict(state)
        self._changes += 1
        await self._notify_if_ready()


# The Ray actor class. num_cpus=0: the buffer is I/O-bound bookkeeping and must not hold a CPU slot that a rollout
# or training worker needs. Restarts are off here; make_replay_actor turns them on.
ReplayBufferActor = ray.remote(num_cpus=0, max_restarts=0)(AsyncReplayBuffer)


def make_replay_actor(
    b_max: int,
    b_min: int,
    a_max: int,
    *,
    seed: int | None = None,
    entry_unit: str = "step",
    snapshot_path: str | None = None,
    snapshot_every_s: float | None = None,
    max_restarts: int = -1,
    max_task_retries: int = 0,
    name: str | None = None,
    namespace: str | None = None,
    lifetime: str | None = None,
):
    """Create a :data:`ReplayBufferActor` handle.

    ``max_restarts=-1`` restarts forever; with ``snapshot_path`` a restarted actor resumes from its last snapshot
    (anything added after it is lost, so pair restarts with ``snapshot_every_s``). ``max_task_retries`` defaults to
    0 because ``sample``/``on_update`` are not idempotent; ``add`` is (duplicate uids are skipped), so a producer
    may safely retry it itself. Arguments are validated here, in the caller, so mistakes raise ``ValueError``
    immediately rather than as a Ray actor-creation failure.
    """
    ReplayBuffer(b_max, b_min, a_max, seed, entry_unit=entry_unit)  # validate sizes eagerly
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
    )
