"""Every tenant's current adapter served at once from one engine with a bounded adapter cache.

Each tenant has its own :class:`~claas_verl.claas.adapter_switch.AdapterSwitch`: a request leases the tenant's
adapter served when it starts and keeps it to its last token, whatever reloads happen meanwhile (per tenant, the
versioned switch of the single-tenant service). Version 0 of every tenant is the base model (the LoRA's initial
``B = 0`` leaves the base model's outputs unchanged); every later version is an adapter file loaded under its own
name, ``<tenant>@v<version>``.

The engine holds at most ``capacity`` adapters. Loading one more evicts the least recently used adapter that no
request is running on, even a tenant's served one: the cache remembers every served adapter's path, so the next
request of that tenant loads it again first (on demand). A request is never answered by the base model or refused
because its tenant's adapter was evicted. When every loaded adapter has requests running, the cache goes over
``capacity`` rather than refuse (counted in ``over_capacity``).

The engine is reached through two callbacks, ``load(name, path)`` and ``unload(name)``. The class is not
thread-safe: its caller serialises the calls (the HF backend holds its generation lock). Standard library only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from claas_verl.claas.adapter_switch import AdapterLease, AdapterSwitch
from claas_verl.claas.tenants.config import check_tenant_names

#: the served name of version 0 (the base model), shared by all tenants and never loaded or evicted
BASE = "<base>"


def adapter_name(tenant: str, version: int) -> str:
    return f"{tenant}@v{int(version)}"


class TenantAdapterCache:
    """Per-tenant switches over a bounded cache of loaded adapters (see the module doc)."""

    def __init__(self, tenants, capacity: int, load: Callable[[str, str], None], unload: Callable[[str], None]):
        self.tenants = check_tenant_names(tenants, "TenantAdapterCache tenants")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"the adapter cache capacity must be an int >= 1 (adapters loaded at once), "
                             f"got {capacity!r}")
        self.capacity = capacity
        self._load, self._unload = load, unload
        self._switch = {t: AdapterSwitch(BASE, 0, on_retire=self._retire, keep=(BASE,)) for t in self.tenants}
        self._paths: dict[str, str] = {}  # adapter name -> file, for every adapter a request may still need
        self._loaded: OrderedDict[str, None] = OrderedDict()  # loaded names, least recently used first
        self.counts = {"loads": 0, "reloads": 0, "evictions": 0, "over_capacity": 0, "unloads": 0}

    def switch(self, tenant: str) -> AdapterSwitch:
        try:
            return self._switch[tenant]
        except KeyError:
            raise ValueError(f"no tenant {tenant!r}; tenants: {list(self.tenants)}") from None

    def served(self, tenant: str) -> tuple[str, int]:
        """``(adapter name or BASE, version)`` that ``tenant``'s new requests get."""
        s = self.switch(tenant).current
        return s.name, s.version

    def loaded(self) -> list[str]:
        """Loaded adapter names, least recently used first."""
        return list(self._loaded)

    def acquire(self, tenant: str) -> AdapterLease:
        """Lease ``tenant``'s served adapter for one request, loading it again first if it was evicted."""
        lease = self.switch(tenant).acquire()
        try:
            if lease.name != BASE:
                self._ensure(lease.name, reload=True)
        except BaseException:
            lease.release()
            raise
        return lease

    def stage(self, tenant: str, version: int, path: str) -> str:
        """Load ``tenant``'s ``version`` from ``path`` next to what it serves (not served yet); returns its name.
        Follow with :meth:`commit` to serve it or :meth:`discard` to drop it."""
        current = self.switch(tenant).current.version
        if version <= current:
            raise ValueError(f"tenant {tenant!r} serves v{current}; a reload must bring a later version, "
                             f"got v{version}")
        name = adapter_name(tenant, version)
        self._paths[name] = str(path)
        try:
            self._ensure(name, reload=False)
        except BaseException:
            self._paths.pop(name, None)
            raise
        return name

    def commit(self, tenant: str, version: int) -> None:
        """Serve the staged ``version`` to ``tenant``'s new requests; its previous adapter is unloaded when its
        last request ends."""
        name = adapter_name(tenant, version)
        if name not in self._paths:
            raise ValueError(f"{name} was not staged")
        self.switch(tenant).switch(name, version)

    def discard(self, tenant: str, version: int) -> None:
        """Drop a staged version that will not be served (a failed verification)."""
        name = adapter_name(tenant, version)
        self._paths.pop(name, None)
        if name in self._loaded:
            del self._loaded[name]
            self._unload(name)
            self.counts["unloads"] += 1

    def _ensure(self, name: str, reload: bool) -> None:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        while len(self._loaded) >= self.capacity:
            victim = next((n for n in self._loaded if self._inflight(n) == 0), None)
            if victim is None:
                self.counts["over_capacity"] += 1
                break
            del self._loaded[victim]
            self._unload(victim)
            self.counts["evictions"] += 1
        self._load(name, self._paths[name])
        self._loaded[name] = None
        self.counts["reloads" if reload else "loads"] += 1

    def _inflight(self, name: str) -> int:
        tenant = name.rsplit("@v", 1)[0]
        return self._switch[tenant].inflight(name) if tenant in self._switch else 0

    def _retire(self, name: str) -> None:
        """A replaced adapter's last request ended: it will never be served again."""
        self._paths.pop(name, None)
        if name in self._loaded:
            del self._loaded[name]
            self._unload(name)
            self.counts["unloads"] += 1

    def stats(self) -> dict:
        return {"tenants": {t: {"adapter": self.served(t)[0], "version": self.served(t)[1]} for t in self.tenants},
                "loaded": self.loaded(), "capacity": self.capacity, **self.counts}


class TenantServedView:
    """What a multi-tenant backend reports about its tenants' served adapters (mixed in before the backend class):
    needs ``self.cache`` (a :class:`TenantAdapterCache`), ``self._tenant_digests`` (``(tenant, version) ->
    digest`` of every version served), ``served_model`` (the base model's name) and ``tenant_model_name``."""

    @property
    def policy_version(self) -> int:
        """The newest version served to any tenant (per tenant: :meth:`served_version`)."""
        return max(self.cache.served(t)[1] for t in self.cache.tenants)

    def served_version(self, tenant: str) -> int:
        return self.cache.served(tenant)[1]

    def adapter_sha256(self, tenant: str | None, version: int) -> str | None:
        """The digest of the adapter ``tenant`` was served at ``version`` (None: version 0, the base model)."""
        return self._tenant_digests.get((tenant, int(version)))

    def model_names(self) -> list[str]:
        return sorted({self.served_model, *(self.tenant_model_name(t, self.served_version(t))
                                            for t in self.cache.tenants)})

    def _verify_staged(self, tenant: str, version: int, probe, score: Callable[[list[int]], list[float]]) -> None:
        """Serve-or-drop of a staged version: ``score(probe.ids)`` is the engine's log-probs with it; a probe that
        does not accept them (or fails) drops the version (``AdapterRejected``); the tenant keeps its previous one."""
        from claas_verl.claas.service.backend import AdapterRejected

        try:
            accepted = probe.accept(score(probe.ids))
        except BaseException:
            self.cache.discard(tenant, version)
            raise
        if not accepted:
            self.cache.discard(tenant, version)
            raise AdapterRejected(f"tenant {tenant!r}: the adapter loaded as v{version} failed the serving probe; "
                                  f"still serving v{self.served_version(tenant)}")
