"""Tenants of CLaaS: one continually trained adapter per tenant behind one API.

``config`` the tenant schema and the key -> tenant directory; ``scheduler`` which tenant the trainer updates next;
``adapters`` each tenant's adapter lineage, weight digest and the store that keeps idle tenants off the accelerator;
``memory`` the bytes one tenant rests in; ``verify`` the check that a reloaded adapter serves what was trained;
``serving`` every tenant's served adapter at once over a bounded adapter cache. The replay side is
:mod:`claas_verl.claas.replay.partitions`, the HF engine side :mod:`claas_verl.claas.service.hf_tenants`; the chat
service (:mod:`claas_verl.claas.service.app`) routes each key to its tenant's ledger, partition and adapter. The
training job's side: :mod:`claas_verl.claas.trainer.tenants_side` (driver) and
:mod:`claas_verl.claas.trainer.tenant_worker` (the swap inside verl's actor worker).
"""
