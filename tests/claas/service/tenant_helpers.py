"""Shared pieces of the multi-tenant service tests: two tenants' keys and a scripted backend that serves one version
per tenant (imported by path-unique name; tests dirs have no __init__)."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
from service_helpers import USER

from claas_verl.claas.replay.partitions import PartitionedReplay
from claas_verl.claas.service import ChatBackend, Generation

ALICE, ALICE_2, BOB = "sk-alice-1", "sk-alice-2", "sk-bob"
TENANTS = {"alice": {"api_keys": [ALICE, ALICE_2], "b_min": 1, "b_max": 8, "a_max": 100},
           "bob": {"api_keys": [BOB], "b_min": 1, "b_max": 8, "a_max": 100}}


def partitions(tenants=None) -> PartitionedReplay:
    tenants = tenants or TENANTS
    return PartitionedReplay(partitions={t: {k: c[k] for k in ("b_min", "b_max", "a_max")}
                                         for t, c in tenants.items()}, seed=0)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, **body}, headers=auth(key), timeout=30)


def feedback(url: str, rid: str, reward, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": reward}, headers=auth(key),
                      timeout=30)


class TenantScripted(ChatBackend):
    """Answers each tenant's chat with its own tokens (the tenant's name decides them) at the tenant's own served
    version; records the tenant of every call. A reload names its tenant; its digest is the SHA-256 of the path."""

    def __init__(self, tenants, delay_s: float = 0.0):
        self.versions = {t: 0 for t in tenants}
        self.digests: dict[tuple[str, int], str] = {}
        self.seen: list[str] = []
        self.delay_s = delay_s

    @property
    def served_model(self):
        return "scripted"

    @property
    def policy_version(self):
        return max(self.versions.values())

    def served_version(self, tenant):
        if tenant not in self.versions:
            raise ValueError(f"unknown tenant {tenant!r}")
        return self.versions[tenant]

    def adapter_sha256(self, tenant, version):
        return self.digests.get((tenant, version))

    async def generate(self, messages, params, chat_template_kwargs=None, tenant=None):
        if tenant not in self.versions:
            raise ValueError(f"unknown tenant {tenant!r}")
        self.seen.append(tenant)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        token = 10 + sorted(self.versions).index(tenant)
        return Generation(prompt_ids=[1, 2, 3], response_ids=[token, 2], token_logprobs=[-1.0, -2.0],
                          text=f"hi {tenant}", finish_reason="stop", policy_version=self.versions[tenant],
                          model=f"scripted-{tenant}")

    async def load_adapter(self, path, version=None, tenant=None):
        if tenant not in self.versions:
            raise ValueError(f"unknown tenant {tenant!r}")
        self.versions[tenant] = self.versions[tenant] + 1 if version is None else version
        self.digests[(tenant, self.versions[tenant])] = hashlib.sha256(str(path).encode()).hexdigest()
        return self.versions[tenant]
