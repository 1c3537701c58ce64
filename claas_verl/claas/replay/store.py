"""Ray object-store side of the reference path (see ``refs.py``): put a batch once, fetch sampled rows directly.

- :func:`put_batch` (producers): validate a batch of step entries, ``ray.put`` its ONE token buffer and return the
  :class:`~claas_verl.claas.replay.refs.RefBatch` to send to the replay actor's ``add``.
- :func:`send_format` (producers): ``put_batch`` for a Ray actor handle, the copy format for an in-process one.
- :func:`fetch_entries` (the trainer): turn what ``sample`` returned into full :class:`ReplayEntry` objects with one
  ``ray.get`` of the distinct batch buffers (zero-copy views on the trainer's node).
- :func:`adopt_refs` (the actor): take ownership of producer-owned buffers, so they outlive their producer.
- :func:`materialize_state` (snapshots): a buffer state whose EntryRefs are replaced by full entries.

Ray is imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from claas_verl.claas.replay.entry import ReplayEntry
from claas_verl.claas.replay.packed import PackedEntries, wire_format
from claas_verl.claas.replay.refs import BatchHandle, EntryRef, RefBatch


def put_batch(entries: Sequence | PackedEntries) -> RefBatch | list:
    """What a producer sends on the reference path.

    Step entries (a list of :class:`ReplayEntry` or a :class:`PackedEntries`) are packed, validated here in full
    (the actor checks only the metadata: it never sees the tokens) and their token buffer is put into the object
    store once; the caller gets a :class:`RefBatch`. Anything else (scenario entries, an empty list) is returned
    unchanged, to be sent by copy. Without a Ray session there is no object store (an in-process handle): step
    entries are then sent by copy as one ``PackedEntries``. Raises ``ValueError`` naming the entry and field on bad
    input.
    """
    import ray

    if isinstance(entries, PackedEntries):
        packed = entries
    else:
        entries = list(entries)
        if not entries or not all(type(e) is ReplayEntry for e in entries):
            return entries
        packed = PackedEntries.from_entries(entries)
    if not ray.is_initialized():
        return packed
    packed.validate()
    ref = ray.put(packed.tokens)
    node_id = ray.get_runtime_context().get_node_id()
    return RefBatch(handle=BatchHandle(ref, packed.tokens.shape[0], node_id), columns=packed.without_tokens())


def send_format(handle: Any, entries: Sequence) -> RefBatch | PackedEntries | list:
    """What to send to ``handle.add.remote``: by reference (:func:`put_batch`) when ``handle`` is a Ray actor handle,
    else (an in-process stand-in, which has no object store to read from) by copy as ``wire_format`` does."""
    try:
        from ray.actor import ActorHandle
    except ImportError:  # Ray not installed: nothing can be held by reference
        ActorHandle = ()  # noqa: N806
    if isinstance(handle, ActorHandle):
        return put_batch(entries)
    return wire_format(entries)


def fetch_entries(items: Sequence | None) -> list | None:
    """Full entries for what ``sample``/``sample_when_ready``/``entries`` returned (``None`` passes through).

    :class:`~claas_verl.claas.replay.refs.EntryRef` items are rebuilt from their batch buffers, fetched with ONE
    ``ray.get`` straight from the object store (each distinct batch once); entries held by copy are returned as
    they are. The order is kept.
    """
    if items is None:
        return None
    handles: dict[int, BatchHandle] = {}
    for item in items:
        if isinstance(item, EntryRef):
            handles.setdefault(id(item.handle), item.handle)
    if not handles:
        return list(items)
    import ray

    keys = list(handles)
    buffers = dict(zip(keys, ray.get([handles[k].ref for k in keys])))
    return [item.materialize(buffers[id(item.handle)]) if isinstance(item, EntryRef) else item for item in items]


def materialize_state(state: dict) -> dict:
    """A copy of a ``ReplayBuffer.state_dict()`` whose EntryRefs are full entries (tokens fetched from the object
    store), so that a snapshot holds everything and a restarted actor loses nothing that was snapshotted."""
    slots = state["slots"]
    refs = [entry for entry, *_ in slots if isinstance(entry, EntryRef)]
    if not refs:
        return state
    full = iter(fetch_entries(refs))
    # Detach from the object store: the views would otherwise pin the batch buffers while the snapshot exists.
    out = []
    for entry, *rest in slots:
        if isinstance(entry, EntryRef):
            e = next(full)
            e.prompt_ids, e.response_ids = e.prompt_ids.copy(), e.response_ids.copy()
            e.prompt_ids.flags.writeable = e.response_ids.flags.writeable = False
            entry = e
        out.append((entry, *rest))
    return {**state, "slots": out}


class _Adopter:
    """Returns its arguments: a call's return values are owned by the caller, so the replay actor calling
    ``keep`` becomes the owner of copies of producer-owned buffers (one long-lived instance per node). The last
    return value is a small marker (inline, never in the object store): getting it says the copies exist without
    fetching them."""

    def keep(self, *buffers):
        return (*buffers, True)


_adopters: dict = {}


def adopt_refs(handles: Sequence[BatchHandle]) -> list[tuple[list[BatchHandle], list, Any]]:
    """Start taking ownership of the handles' buffers; return ``(handles, new_refs, marker)`` per node.

    Ray frees an object when its owner (the process that put it) dies, so a buffer put by a producer would be lost
    with the producer. Return values are owned by the caller, so the caller (the replay actor) sends the buffers to
    an ``_Adopter`` actor on their node (one call per node for all pending handles) that returns them: the bytes are
    copied once, inside that node's object store, by the adopter's process, never through the caller. Nothing is
    swapped here: once ``ray.get(marker)`` returns, the caller swaps each ``handle.ref`` for its new ref (until then
    readers keep using the producer's copy and never wait for the adopter). An actor, not a task: a ``num_cpus=0``
    task per adoption round starts worker processes under load.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    by_node: dict[Any, list[BatchHandle]] = {}
    for h in handles:
        by_node.setdefault(h.node_id, []).append(h)
    out = []
    for node_id, group in by_node.items():
        adopter = _adopters.get(node_id)
        if adopter is None:
            options: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1}
            if node_id is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
            adopter = _adopters[node_id] = ray.remote(_Adopter).options(**options).remote()
        *new, marker = adopter.keep.options(num_returns=len(group) + 1).remote(*[h.ref for h in group])
        out.append((group, new, marker))
    return out


def object_store_bytes_used() -> int:
    """Bytes the cluster's object stores hold now (as reported by the raylets; updates within ~1 s)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)
