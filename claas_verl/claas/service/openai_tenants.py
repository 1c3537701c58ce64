"""Several tenants' adapters served at once by one vLLM server (multi-LoRA), through its OpenAI API.

The vLLM counterpart of :class:`~claas_verl.claas.service.hf_tenants.TenantHFBackend`: every request names its
tenant and runs on that tenant's served version, leased for the whole generation
(:class:`~claas_verl.claas.tenants.serving.TenantAdapterCache`); the adapters are loaded into the server with
``POST /v1/load_lora_adapter`` under ``<lora_prefix>-<tenant>-v<version>`` and unloaded with
``/v1/unload_lora_adapter``. The cache holds at most ``max_loaded_adapters`` of them and unloads the least recently
used idle one itself before loading another, so vLLM never has to drop one on its own (an adapter vLLM evicted
from its CPU cache would answer 404): start the server with ``--enable-lora --max-loras`` and ``--max-cpu-loras``
of at least ``max_loaded_adapters``. A tenant whose adapter was unloaded for another's is loaded again before its
next request is sent, never answered by the base model or refused.

A reload (``load_adapter(path, tenant=..., probe=...)``) loads the new version next to the served one and, with a
probe, scores the probe tokens on the server (``POST /v1/completions`` with ``prompt_logprobs``, teacher-forced)
before serving it (:mod:`claas_verl.claas.tenants.verify`); a rejected version is unloaded and the tenant keeps the
previous one. The adapter directories must be readable by the vLLM server at the same path.
"""

from __future__ import annotations

import asyncio
import threading

from claas_verl.claas.service.backend import BackendError, next_version
from claas_verl.claas.service.openai_backend import OpenAIBackend, _file_digest
from claas_verl.claas.service.sampling import SamplingParams
from claas_verl.claas.tenants.serving import BASE, TenantAdapterCache, TenantServedView


class TenantOpenAIBackend(TenantServedView, OpenAIBackend):
    """:class:`OpenAIBackend` with one adapter lineage per tenant (see the module docstring).

    Args:
        base_url, base_model: the vLLM server and the name it serves the base model under.
        tenants: the tenant names.
        max_loaded_adapters: adapters loaded in the server at once (<= its ``--max-cpu-loras``).
        **kwargs: as :class:`OpenAIBackend` (no ``adapter_path``/``adapter_name``: tenants start at the base model).
    """

    def __init__(self, base_url: str, base_model: str, tenants, max_loaded_adapters: int = 2, **kwargs):
        if kwargs.get("adapter_path") is not None or kwargs.get("adapter_name") is not None:
            raise ValueError("a TenantOpenAIBackend starts every tenant at the base model; load adapters per tenant")
        super().__init__(base_url, base_model, unload_old=False, **kwargs)
        self._cache_lock = threading.Lock()  # the cache is not thread-safe; its load/unload are blocking HTTP
        self.cache = TenantAdapterCache(tenants, max_loaded_adapters, self._load_named, self._unload_named)
        self._tenant_digests: dict[tuple[str, int], str] = {}

    # ------------------------------------------------------------------ what is served (and TenantServedView)
    @property
    def served_model(self) -> str:
        return self.base_model

    def tenant_model_name(self, tenant: str, version: int) -> str:
        return self.base_model if version == 0 else self._vllm_name(f"{tenant}@v{int(version)}")

    # ------------------------------------------------------------------ requests
    async def generate(self, messages, params: SamplingParams, chat_template_kwargs=None, tenant: str | None = None):
        lease = await asyncio.to_thread(self._acquire, tenant)
        try:
            model = self._model_of(lease.name)
            return await self._post_chat(model, self.tenant_model_name(tenant, lease.version), lease.version,
                                         messages, params, chat_template_kwargs)
        finally:
            await asyncio.to_thread(self._release, lease)

    async def stream(self, messages, params: SamplingParams, chat_template_kwargs=None, tenant: str | None = None):
        lease = await asyncio.to_thread(self._acquire, tenant)
        try:  # the lease is held until the stream ends or is closed: the adapter stays loaded
            async for item in self._stream_chat(self._model_of(lease.name),
                                                self.tenant_model_name(tenant, lease.version), lease.version,
                                                messages, params, chat_template_kwargs):
                yield item
        finally:
            await asyncio.to_thread(self._release, lease)

    # ------------------------------------------------------------------ reloads
    async def load_adapter(self, path, version=None, probe=None, tenant: str | None = None) -> int:
        """Serve the adapter at ``path`` to ``tenant`` as ``version`` (default: its current + 1), verified by
        ``probe`` when given (``AdapterRejected``: the tenant keeps its previous version)."""
        if tenant is None:
            raise ValueError(f"name the tenant whose adapter this is; tenants: {list(self.cache.tenants)}")
        return await asyncio.to_thread(self._load_sync, str(path), version, probe, tenant)

    def _load_sync(self, path: str, version: int | None, probe, tenant: str) -> int:
        digest = _file_digest(path)
        with self._cache_lock:  # held through the probe: no other tenant's request can unload the staged adapter
            new = next_version(self.served_version(tenant), version)
            name = self.cache.stage(tenant, new, path)
            if probe is not None:
                self._verify_staged(tenant, new, probe, lambda ids: self._score_locked(self._vllm_name(name), ids))
            if digest is not None:
                self._tenant_digests[(tenant, new)] = digest
            self.cache.commit(tenant, new)
            return new

    def score_probe(self, ids: list[int], tenant: str) -> list[float]:
        """``tenant``'s served log-probs of the probe tokens (teacher-forced), as a request of it would see them."""
        lease = self._acquire(tenant)
        try:
            with self._cache_lock:
                return self._score_locked(self._model_of(lease.name), ids)
        finally:
            self._release(lease)

    def _score_locked(self, model: str, ids: list[int]) -> list[float]:
        """``log p(ids[j] | ids[:j])`` for ``j >= 1`` on the server's ``model``: one completion request whose prompt
        is ``ids``, with the prompt tokens' own log-probs (``prompt_logprobs=0``)."""
        import httpx

        body = {"model": model, "prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}
        try:
            resp = httpx.post(f"{self.base_url}/v1/completions", json=body, headers=self._http.headers,
                              timeout=120)
        except httpx.HTTPError as exc:
            raise BackendError(f"inference server {self.base_url} unreachable: {exc!r}") from exc
        if resp.status_code >= 400:
            raise BackendError(f"scoring the serving probe: HTTP {resp.status_code}: {resp.text[:300]}")
        rows = resp.json()["choices"][0].get("prompt_logprobs")
        if not rows or len(rows) != len(ids):
            raise BackendError(f"the inference server returned no prompt log-probs for the probe ({str(rows)[:200]})")
        out = []
        for j in range(1, len(ids)):
            entry = rows[j] or {}
            hit = entry.get(str(int(ids[j])))
            if hit is None:
                raise BackendError(f"the prompt log-probs hold no entry for probe token {ids[j]} at position {j}")
            out.append(float(hit["logprob"]))
        return out

    # ------------------------------------------------------------------ the cache side
    def _vllm_name(self, name: str) -> str:
        return f"{self.lora_prefix}-{name.replace('@v', '-v')}"

    def _model_of(self, cache_name: str) -> str:
        return self.base_model if cache_name == BASE else self._vllm_name(cache_name)

    def _acquire(self, tenant: str | None):
        if tenant is None:
            raise ValueError(f"a multi-tenant backend needs the request's tenant; tenants: {list(self.cache.tenants)}")
        with self._cache_lock:
            return self.cache.acquire(tenant)  # loads the tenant's adapter again if it was unloaded

    def _release(self, lease) -> None:
        with self._cache_lock:  # the last request of a replaced version unloads it (cache -> _unload_named)
            lease.release()

    def _load_named(self, name: str, path: str) -> None:
        self.lora.load(self._vllm_name(name), path)

    def _unload_named(self, name: str) -> None:
        try:
            self.lora.unload(self._vllm_name(name))
            self.unloaded.append(name)
        except Exception as exc:  # a failed unload leaks one LoRA slot; it must not fail any request
            self.unload_errors.append(f"{name}: {exc!r}")
