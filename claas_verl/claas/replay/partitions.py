"""One replay partition per tenant: a :class:`~claas_verl.claas.replay.buffer.ReplayBuffer` each (no Ray import).

Each partition is Algorithm 1 on its own (docs/math.md §A.1): its own ``B_min`` (readiness), ``B_max`` (FIFO
capacity), ``A_max`` and update counter ``k``, counted in the updates of ITS tenant only, and its own RNG, so a
mini-batch is drawn uniformly from one tenant's entries. Nothing crosses partitions: an add, a FIFO or age eviction,
a sample or an ``on_update`` of one tenant reads and writes that tenant's buffer only.

Without partitions the actor holds one implicit partition, :data:`~claas_verl.claas.tenants.config.DEFAULT_TENANT`,
built from the plain ``b_max``/``b_min``/``a_max``/``seed`` arguments exactly as before; its snapshot is the plain
``ReplayBuffer.state_dict()`` (older snapshots load unchanged). A partitioned snapshot maps each tenant to its
buffer's state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from claas_verl.claas.replay.buffer import ReplayBuffer
from claas_verl.claas.tenants.config import DEFAULT_TENANT, check_tenant_names

_PARTITIONED_FORMAT = "partitioned-1"
_SIZES = ("b_min", "b_max", "a_max")


def partition_seed(seed: int | None, tenant: str) -> int | None:
    """The RNG seed of ``tenant``'s partition: a stable function of the actor's seed and the name (None stays None),
    so two tenants never draw the same index sequence and adding a tenant changes no other tenant's draws."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{tenant}".encode()).digest()[:8], "big")


class PartitionedReplay:
    """Replay buffers by tenant name.

    Args:
        partitions: ``{tenant: {"b_min", "b_max", "a_max"}}`` (``TenantDirectory.replay_partitions()``), or None
            for the single implicit partition built from ``b_max``/``b_min``/``a_max``.
        seed: the actor's seed; the implicit partition uses it as is, a named one :func:`partition_seed`.
    """

    def __init__(self, b_max: int | None = None, b_min: int | None = None, a_max: int | None = None,
                 seed: int | None = None, entry_unit: str = "step",
                 partitions: Mapping[str, Mapping[str, int]] | None = None):
        plain = (b_max, b_min, a_max)
        if partitions is None:
            if any(v is None for v in plain):
                raise ValueError("the replay buffer needs b_max, b_min and a_max (or partitions: one per tenant)")
            self.implicit = True
            self._parts = {DEFAULT_TENANT: ReplayBuffer(b_max, b_min, a_max, seed, entry_unit=entry_unit)}
            return
        if any(v is not None for v in plain):
            raise ValueError("give either b_max/b_min/a_max (one implicit partition) or partitions (one per tenant), "
                             "not both")
        if not isinstance(partitions, Mapping):
            raise ValueError(f"partitions must map tenant -> {{b_min, b_max, a_max}}, got {type(partitions).__name__}")
        check_tenant_names(list(partitions), "replay partitions")
        self.implicit = False
        self._parts = {}
        for name, sizes in partitions.items():
            missing = [k for k in _SIZES if k not in sizes]
            extra = sorted(set(sizes) - set(_SIZES))
            if missing or extra:
                raise ValueError(f"replay partition {name!r}: needs exactly {list(_SIZES)}, missing {missing}, "
                                 f"unknown {extra}")
            try:
                self._parts[name] = ReplayBuffer(sizes["b_max"], sizes["b_min"], sizes["a_max"],
                                                 partition_seed(seed, name), entry_unit=entry_unit)
            except ValueError as exc:
                raise ValueError(f"replay partition {name!r}: {exc}") from exc

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._parts)

    def part(self, tenant: str | None) -> ReplayBuffer:
        """The partition of ``tenant``; None names the implicit one (refused when the actor is partitioned, so a
        caller that forgot the tenant cannot write into, or train on, someone's partition by default)."""
        if tenant is None:
            if self.implicit:
                return self._parts[DEFAULT_TENANT]
            raise ValueError(f"this replay actor is partitioned by tenant {list(self._parts)}: name the tenant")
        try:
            return self._parts[tenant]
        except KeyError:
            raise ValueError(f"no replay partition for tenant {tenant!r}; partitions: {list(self._parts)}") from None

    def items(self):
        return self._parts.items()

    def ready_tenants(self) -> list[str]:
        """Tenants whose partition holds at least its ``B_min`` entries, in partition order."""
        return [n for n, b in self._parts.items() if b.ready()]

    def total_size(self) -> int:
        return sum(len(b) for b in self._parts.values())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The implicit partition's plain ``ReplayBuffer`` state, or ``{format, partitions: {tenant: state}}``."""
        if self.implicit:
            return self._parts[DEFAULT_TENANT].state_dict()
        return {"format": _PARTITIONED_FORMAT, "partitions": {n: b.state_dict() for n, b in self._parts.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; the tenants must be the same (by name). All or nothing: on error no
        partition changes."""
        if self.implicit:
            if isinstance(state, dict) and state.get("format") == _PARTITIONED_FORMAT:
                raise ValueError("the state is partitioned by tenant but this replay actor has one implicit partition")
            self._parts[DEFAULT_TENANT].load_state_dict(state)
            return
        if not isinstance(state, dict) or state.get("format") != _PARTITIONED_FORMAT:
            raise ValueError("the state is a single buffer's but this replay actor is partitioned by tenant; "
                             "resume from a partitioned snapshot")
        saved = list(state["partitions"])
        if sorted(saved) != sorted(self._parts):
            raise ValueError(f"the state holds tenants {saved} but this replay actor has {list(self._parts)}")
        rebuilt = {}
        for name, part_state in state["partitions"].items():
            buf = self._parts[name]
            fresh = ReplayBuffer(buf.b_max, buf.b_min, buf.a_max, entry_unit=buf.entry_unit)
            try:
                fresh.load_state_dict(part_state)
            except ValueError as exc:
                raise ValueError(f"replay partition {name!r}: {exc}") from exc
            rebuilt[name] = fresh
        self._parts = {n: rebuilt[n] for n in self._parts}

    def map_states(self, state: dict, fn) -> dict:
        """``state`` (from :meth:`state_dict`) with ``fn`` applied to every buffer state in it."""
        if state.get("format") == _PARTITIONED_FORMAT:
            return {**state, "partitions": {n: fn(s) for n, s in state["partitions"].items()}}
        return fn(state)
