"""LoRA hot-reload: the vLLM adapter client and the atomic switch of the served adapter.

vLLM serves LoRA adapters by name and loads new ones at runtime through ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) when started with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``. A chat request selects an adapter by passing its name
as ``model``.

Every update is loaded under a NEW name (``"{prefix}-v{version}"``): vLLM caches adapters by name, so reusing a name
would keep serving the old weights. :class:`AdapterSwitch` then swaps ``(name, version)`` in one step; requests that
already hold a lease on the old name finish on it (and record its version), and the old adapter is unloaded only
when its last lease is released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


class LoRAReloadError(RuntimeError):
    """The inference server refused to load or unload an adapter."""


class VLLMLoRAClient:
    """Synchronous HTTP client for vLLM's runtime LoRA endpoints (safe to call from any thread).

    Args:
        base_url: the vLLM server, ``http://host:port`` (a trailing ``/v1`` is accepted).
        api_key: sent as ``Authorization: Bearer`` when the server was started with ``--api-key``.
        timeout_s: per-call timeout (loading a large adapter from a network disk can take a while).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0):
        import httpx

        self.base_url = strip_v1(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def _post(self, path: str, body: dict) -> str:
        import httpx

        try:
            resp = self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise LoRAReloadError(f"POST {self.base_url}{path} failed: {exc!r}") from exc
        if resp.status_code >= 400:
            hint = ""
            if resp.status_code == 404:
                hint = " (start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)"
            raise LoRAReloadError(f"POST {path} {body} -> HTTP {resp.status_code}: {resp.text[:500]}{hint}")
        return resp.text

    def load(self, lora_name: str, lora_path: str) -> None:
        """Load the adapter directory ``lora_path`` under ``lora_name``."""
        self._post("/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path)})

    def unload(self, lora_name: str) -> None:
        """Unload the adapter ``lora_name``."""
        self._post("/v1/unload_lora_adapter", {"lora_name": lora_name})

    def close(self) -> None:
        self._client.close()


def strip_v1(base_url: str) -> str:
    """``http://h:p/v1/`` -> ``http://h:p``; the clients add the ``/v1/...`` paths themselves."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


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
