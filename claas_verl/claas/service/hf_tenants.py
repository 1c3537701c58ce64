"""Several tenants' adapters served at once by the in-process HF backend (CPU): multi-LoRA on one PEFT model.

Every request names its tenant; it runs on that tenant's served version, leased for the whole generation
(:class:`~claas_verl.claas.tenants.serving.TenantAdapterCache`), and the reply records that version. The PEFT model
holds at most ``max_loaded_adapters`` adapters; one evicted to make room for another tenant's is loaded again from
its file when its tenant's next request starts, never answered by the base model. A reload (``load_adapter(path,
tenant=...)``) loads the new version next to the served one and, with a ``probe``, serves it only once the probe's
scores are accepted (:mod:`claas_verl.claas.tenants.verify`); a rejected version is dropped and the tenant keeps
the previous one.

Generation runs one request at a time under the backend's lock (as :class:`HFBackend`); the adapter of the request
is selected under that lock, so concurrent tenants never see each other's weights.

The chat service passes each request's tenant (from its API key) when it is configured with tenants. Each served
version's adapter digest (:func:`~claas_verl.claas.tenants.adapters.adapter_file_digest`) is kept for the replies'
``adapter_sha256``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import warnings

from claas_verl.claas.service.backend import next_version
from claas_verl.claas.service.hf_backend import HFBackend
from claas_verl.claas.tenants.serving import BASE, TenantAdapterCache, TenantServedView


class TenantHFBackend(TenantServedView, HFBackend):
    """:class:`HFBackend` with one adapter lineage per tenant.

    Args:
        model_path: the base model (every tenant's version 0).
        tenants: the tenant names.
        max_loaded_adapters: adapters the PEFT model holds at once (tenants beyond it are reloaded on demand).
        **kwargs: as :class:`HFBackend` (no ``adapter_path``: tenants start at the base model).
    """

    def __init__(self, model_path, tenants, max_loaded_adapters: int = 2, **kwargs):
        if kwargs.get("adapter_path") is not None:
            raise ValueError("a TenantHFBackend starts every tenant at the base model; load adapters per tenant")
        super().__init__(model_path, **kwargs)
        self._peft_names: dict[str, str] = {}  # cache name -> PEFT adapter name (PEFT names cannot hold '.')
        self._next_peft = 0
        self.cache = TenantAdapterCache(tenants, max_loaded_adapters, self._load_named, self._unload_named)
        self._tenant_digests: dict[tuple[str, int], str] = {}  # (tenant, version) -> digest, every version served

    # ------------------------------------------------------------------ what is served (and TenantServedView)
    @property
    def served_model(self) -> str:
        return self.model_name

    def tenant_model_name(self, tenant: str, version: int) -> str:
        return self.model_name if version == 0 else f"{self.model_name}-{tenant}-v{version}"

    # ------------------------------------------------------------------ reloads
    async def load_adapter(self, path, version=None, probe=None, tenant: str | None = None) -> int:
        """Serve the adapter at ``path`` to ``tenant`` as ``version`` (default: its current + 1), verified by
        ``probe`` when given (``AdapterRejected``: the tenant keeps its previous version)."""
        if tenant is None:
            raise ValueError(f"name the tenant whose adapter this is; tenants: {list(self.cache.tenants)}")
        path = str(path)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"lora_path {path!r} is not a peft adapter directory (no adapter_config.json)")

        def work() -> int:
            from claas_verl.claas.tenants.adapters import adapter_file_digest

            digest = adapter_file_digest(path)  # before the lock: a file read, not the engine
            with self._lock:
                new = next_version(self.served_version(tenant), version)
                name = self.cache.stage(tenant, new, path)
                if probe is not None:
                    self._verify_staged_locked(tenant, new, name, probe)
                self._tenant_digests[(tenant, new)] = digest
                self.cache.commit(tenant, new)
                return new

        return await asyncio.to_thread(work)

    def _verify_staged_locked(self, tenant: str, version: int, name: str, probe) -> None:
        from claas_verl.claas.tenants.verify import probe_token_logprobs

        def score(ids: list[int]) -> list[float]:
            self.model.set_adapter(self._peft_names[name])
            return probe_token_logprobs(self.model, ids)

        self._verify_staged(tenant, version, probe, score)

    def score_probe(self, ids: list[int], tenant: str) -> list[float]:
        """``tenant``'s served log-probs of the probe tokens (teacher-forced), as a request of it would see them."""
        from claas_verl.claas.tenants.verify import probe_token_logprobs

        with self._lock:
            _, _, scope = self._serve_locked(tenant)
            with scope:
                return probe_token_logprobs(self.model, ids)

    # ------------------------------------------------------------------ the engine side (the lock held)
    def _serve_locked(self, tenant):
        if tenant is None:
            raise ValueError(f"a multi-tenant backend needs the request's tenant; tenants: {list(self.cache.tenants)}")
        lease = self.cache.acquire(tenant)  # loads the tenant's adapter again if it was evicted
        try:
            if lease.name == BASE:
                adapter = self.model.disable_adapter() if self._peft_names else contextlib.nullcontext()
            else:
                self.model.set_adapter(self._peft_names[lease.name])
                adapter = contextlib.nullcontext()
        except BaseException:
            lease.release()
            raise
        scope = contextlib.ExitStack()
        scope.callback(lease.release)
        scope.enter_context(adapter)
        return lease.version, self.tenant_model_name(tenant, lease.version), scope

    def _load_named(self, name: str, path: str) -> None:
        from peft import PeftModel

        peft_name = f"adapter{self._next_peft}"
        self._next_peft += 1
        if isinstance(self.model, PeftModel):
            self.model.load_adapter(path, adapter_name=peft_name)
        else:
            self.model = PeftModel.from_pretrained(self.model, path, adapter_name=peft_name)
        self.model.eval()
        self._peft_names[name] = peft_name

    def _unload_named(self, name: str) -> None:
        with warnings.catch_warnings():  # PEFT warns when the active adapter goes; every request selects its own
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.model.delete_adapter(self._peft_names.pop(name))
