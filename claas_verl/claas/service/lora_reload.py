"""LoRA hot-reload: the vLLM adapter client (the switch of the served adapter is :mod:`.adapter_switch`).

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

from claas_verl.claas.adapter_switch import AdapterLease, AdapterSwitch, Served

__all__ = ["AdapterLease", "AdapterSwitch", "LoRAReloadError", "Served", "VLLMLoRAClient", "strip_v1"]


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
