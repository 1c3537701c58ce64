"""The served adapter and its atomic switch: a thread-safe state machine, standard library only.

Every update is served under a NEW name (vLLM caches adapters by name, so reusing one would keep serving the old
weights). :class:`AdapterSwitch` swaps ``(name, version)`` in one step; requests that already hold a lease on the
old name finish on it (and record its version), and the old adapter is retired only when its last lease is
released. Both the chat API's vLLM client (:mod:`claas_verl.claas.service.lora_reload`) and the versioned LoRA engine
inside verl's vLLM rollout (:mod:`claas_verl.claas.lora_versions`) build on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Served:
    """What new requests are sent to: the model/adapter name and its policy version."""

    name: str
    version: int


class AdapterLease:
    """One request's hold on a served adapter; release it exactly once (it is also a context manager)."""

    def __init__(self, switch: AdapterSwitch, served: Served):
        self._switch = switch
        self.served = served
        self._released = False

    @property
    def name(self) -> str:
        return self.served.name

    @property
    def version(self) -> int:
        return self.served.version

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._switch._release(self.served.name)

    def __enter__(self) -> AdapterLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AdapterSwitch:
    """The served ``(name, version)`` with in-flight counts per name and deferred retirement (thread-safe).

    ``on_retire(name)`` is called (outside the lock) once a replaced name has no request left on it. Names in
    ``keep`` (the base model) are never retired.
    """

    def __init__(self, name: str, version: int, on_retire: Callable[[str], None] | None = None,
                 keep: tuple[str, ...] = ()):
        self._lock = threading.Lock()
        self._served = Served(name, int(version))
        self._inflight: dict[str, int] = {}
        self._retiring: set[str] = set()
        self._on_retire = on_retire
        self._keep = set(keep)

    @property
    def current(self) -> Served:
        return self._served

    def acquire(self) -> AdapterLease:
        """Lease the currently served adapter; the request uses ``lease.name`` and records ``lease.version``."""
        with self._lock:
            served = self._served
            self._inflight[served.name] = self._inflight.get(served.name, 0) + 1
        return AdapterLease(self, served)

    def switch(self, name: str, version: int) -> Served:
        """Serve ``name`` as ``version`` from now on; returns what was served before."""
        with self._lock:
            old = self._served
            if version <= old.version:
                raise ValueError(f"version must increase: serving v{old.version}, got v{version}")
            self._served = Served(name, int(version))
            retire_now = False
            if old.name != name and old.name not in self._keep:
                if self._inflight.get(old.name, 0) == 0:
                    retire_now = True
                else:
                    self._retiring.add(old.name)
        if retire_now:
            self._retire(old.name)
        return old

    def inflight(self, name: str) -> int:
        with self._lock:
            return self._inflight.get(name, 0)

    def _release(self, name: str) -> None:
        with self._lock:
            left = self._inflight[name] - 1
            if left:
                self._inflight[name] = left
                return
            del self._inflight[name]
            retire = name in self._retiring
            self._retiring.discard(name)
        if retire:
            self._retire(name)

    def _retire(self, name: str) -> None:
        if self._on_retire is not None:
            self._on_retire(name)
