"""CLaaS asynchronous replay buffer (docs/math.md §A.1).

``ReplayEntry``/``ScenarioEntry`` (entries), ``PackedEntries`` (columnar wire format of a batch of steps),
``EntryRef``/``RefBatch`` (entries held by reference: tokens in Ray's object store),
``put_batch``/``send_format``/``fetch_entries`` (producer and trainer side of the reference path; Ray imported on call),
``ReplayBuffer`` (plain class, no Ray), ``PartitionedReplay`` (one ``ReplayBuffer`` per tenant) and, imported
lazily so that ``import claas_verl.claas.replay`` never pulls in Ray, ``AsyncReplayBuffer`` (the asyncio actor body) and
``ReplayBufferActor``/``make_replay_actor`` (the Ray actor).
"""

from claas_verl.claas.replay.buffer import ReplayBuffer, expected_entries_per_split, validate_replay_sizes
from claas_verl.claas.replay.entry import (
    ENTRY_UNITS,
    SCENARIO_REWARD_AGGS,
    ReplayEntry,
    ScenarioEntry,
    aggregate_scenario_reward,
)
from claas_verl.claas.replay.packed import PackedEntries, wire_format
from claas_verl.claas.replay.partitions import PartitionedReplay
from claas_verl.claas.replay.refs import BatchHandle, EntryRef, RefBatch
from claas_verl.claas.replay.snapshot import load_snapshot, save_snapshot
from claas_verl.claas.replay.store import fetch_entries, put_batch, send_format

_LAZY_RAY = ("AsyncReplayBuffer", "ReplayBufferActor", "make_replay_actor")

__all__ = [
    "AsyncReplayBuffer",
    "BatchHandle",
    "ENTRY_UNITS",
    "EntryRef",
    "PackedEntries",
    "PartitionedReplay",
    "RefBatch",
    "SCENARIO_REWARD_AGGS",
    "ReplayBuffer",
    "ReplayBufferActor",
    "ReplayEntry",
    "ScenarioEntry",
    "aggregate_scenario_reward",
    "expected_entries_per_split",
    "fetch_entries",
    "load_snapshot",
    "make_replay_actor",
    "put_batch",
    "save_snapshot",
    "send_format",
    "validate_replay_sizes",
    "wire_format",
]


def __getattr__(name):
    if name in _LAZY_RAY:
        from claas_verl.claas.replay import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'claas_verl.claas.replay' has no attribute {name!r}")
