"""One adapter per tenant inside verl's actor worker: swap a tenant's training state in before its update, out after.

verl's FSDP engine trains ONE LoRA adapter with one optimizer (docs/verl-couplings.md). A multi-tenant CLaaS job
keeps every tenant's state on the host of every training rank (:class:`TenantSlots`: this rank's shards) and, for an
update of tenant ``t``:

1. :meth:`ClaasTenantsWorkerMixin.claas_tenant_swap_in` (all ranks): ``t``'s LoRA shards into the engine's
   parameters, its AdamW moments and learning-rate schedule into the engine's optimizer and scheduler, and, with
   SDPO, its EMA teacher into the worker's :class:`~claas_verl.losses.sdpo.EmaTeacher`;
2. verl's own ``update_actor`` (unchanged);
3. :meth:`~ClaasTenantsWorkerMixin.claas_tenant_export` (optional): the whole new adapter, gathered, written by
   rank 0 as a PEFT adapter directory for the serving engine; its file digest is the version's digest;
4. :meth:`~ClaasTenantsWorkerMixin.claas_tenant_swap_out` (all ranks): everything back to host memory, the
   optimizer state cleared (no tenant's moments stay on the accelerator); a changed adapter becomes ``t``'s next
   version. Returns ``(version, digest)``.

An update of ``t`` therefore equals the same update in a job that trains ``t`` alone (the tests hold it bit for bit
on two FSDP2 ranks), and a tenant that is never swapped in keeps its adapter byte for byte. Checkpoints: every rank
saves its shards into ``<dir>/rank_<r>`` (:meth:`TenantAdapterStore.save`, crash-safe per rank).

The engine's ``module``, ``optimizer`` and ``lr_scheduler`` attributes are private verl names
(:mod:`claas_verl.claas.trainer.verl_couplings`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from verl.single_controller.base.decorator import Dispatch, register

from claas_verl.claas.tenants.adapters import (
    TenantAdapterStore,
    full_adapter,
    lora_digest,
    lora_parameters,
    saved_name,
    to_host,
)
from claas_verl.claas.trainer.sdpo_worker import ClaasSdpoWorker
from claas_verl.claas.trainer.worker import ClaasWorker

EMA_KEY = "sdpo_ema"  # TenantAdapter.extra key of a tenant's SDPO EMA teacher state


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class TenantSlots:
    """One training rank's tenants over one engine (``module`` / ``optimizer`` / ``lr_scheduler``) and, with SDPO,
    its EMA teacher. Build it right after the engine is set up and before any update: the current adapter, empty
    optimizer state and schedule are every tenant's starting point (version 0)."""

    def __init__(self, tenants, engine, ema=None):
        self.engine, self.ema = engine, ema
        module = engine.module
        self.store = TenantAdapterStore(tenants, lora_parameters(module), engine.optimizer,
                                        getattr(engine, "lr_scheduler", None))
        self._ema_initial = None if ema is None else {**to_host(ema.state_dict()), "num_updates": 0}
        self._exported_digest: str | None = None  # the resident adapter's digest, from its export (one gather)

    @property
    def resident(self) -> str | None:
        return self.store.resident

    def swap_in(self, tenant: str) -> None:
        e = self.engine
        self._exported_digest = None
        self.store.swap_in(tenant, e.module, e.optimizer, getattr(e, "lr_scheduler", None))
        if self.ema is not None:
            state = self.store[tenant].extra.get(EMA_KEY, self._ema_initial)
            self.ema.load_state_dict(state)
            self.ema.num_updates = int(state["num_updates"])

    def swap_out(self) -> tuple[int, str]:
        tenant, e = self.store.resident, self.engine
        if tenant is not None and self.ema is not None:
            self.store[tenant].extra[EMA_KEY] = to_host(self.ema.state_dict())
        digest, self._exported_digest = self._exported_digest, None
        return self.store.swap_out(e.module, e.optimizer, getattr(e, "lr_scheduler", None), digest=digest)

    def export(self, path: str) -> str | None:
        """Write the resident tenant's whole adapter as a PEFT adapter directory at ``path`` (rank 0; every rank
        must call it: the shards are gathered). Written to a temporary sibling and renamed, so a reader sees the
        whole directory or none. Returns ``path`` on rank 0, else None."""
        if self.store.resident is None:
            raise RuntimeError("no tenant is resident: export the adapter between swap_in and swap_out")
        module = self.engine.module
        tensors = full_adapter(lora_parameters(module))  # a collective under FSDP2: on every rank
        # swap_out names the version by this digest (the adapter does not change before it): no second gather
        self._exported_digest = lora_digest(tensors)
        if _rank() != 0:
            return None
        from safetensors.torch import save_file

        config = module.peft_config["default"].to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
        try:
            save_file({saved_name(n): t.detach().to("cpu").contiguous() for n, t in tensors.items()},
                      os.path.join(tmp, "adapter_model.safetensors"))
            with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
                json.dump(config, f, indent=1, sort_keys=True, default=str)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def save(self, directory: str) -> str:
        return self.store.save(os.path.join(directory, f"rank_{_rank()}"))

    def load(self, directory: str) -> None:
        self.store.load(os.path.join(directory, f"rank_{_rank()}"))


class ClaasTenantsWorkerMixin:
    """Registered worker methods over :class:`TenantSlots` (mixed into verl's ``ActorRolloutRefWorker`` and into
    the SDPO worker; every call runs on all training ranks)."""

    claas_tenant_slots: TenantSlots | None = None

    def _slots(self) -> TenantSlots:
        if self.claas_tenant_slots is None:
            raise ValueError("claas_tenants_setup was not called: the CLaaS trainer calls it once the engine exists")
        return self.claas_tenant_slots

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_tenants_setup(self, tenants: list[str]) -> dict:
        if self.actor is None:
            raise ValueError("per-tenant adapters need the actor role (actor_rollout)")
        self.claas_tenant_slots = slots = TenantSlots(tenants, self.actor.engine, getattr(self.actor, "ema", None))
        return {t: slots.store.version(t) for t in slots.store.tenants}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_tenant_swap_in(self, tenant: str) -> bool:
        self._slots().swap_in(tenant)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_tenant_export(self, path: str) -> str | None:
        return self._slots().export(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_tenant_probe(self, ids: list[int]) -> list[float]:
        """The resident tenant's teacher-forced log-probs of the serving probe ``ids`` (verified serving: the
        trainer's side of the comparison); a forward on every rank (FSDP gathers the layers)."""
        from claas_verl.verl_ext.weight_probe import engine_prefix_logprobs

        if self._slots().resident is None:
            raise RuntimeError("no tenant is resident: score the probe between swap_in and swap_out")
        return engine_prefix_logprobs(self.actor.engine, ids, [ids[1:]])[0]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_tenant_swap_out(self) -> tuple[int, str]:
        return self._slots().swap_out()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_tenants_save(self, directory: str) -> str:
        return self._slots().save(directory)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def claas_tenants_load(self, directory: str) -> dict:
        slots = self._slots()
        slots.load(directory)
        return {t: slots.store.version(t) for t in slots.store.tenants}


class ClaasTenantsWorker(ClaasTenantsWorkerMixin, ClaasWorker):
    """verl's hybrid actor/rollout worker with per-tenant training state (REINFORCE++)."""


class ClaasSdpoTenantsWorker(ClaasTenantsWorkerMixin, ClaasSdpoWorker):
    """The SDPO worker with per-tenant training state (each tenant's EMA teacher swapped with its adapter)."""
