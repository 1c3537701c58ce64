"""Several tenants behind one CLaaS chat API on CPU, talked to with the ``openai`` client.

    python examples/chat_service_tenants_cpu.py [--max-tokens 12]

What it shows (docs/service.md, Tenants):
1. A ChatService with ``tenants`` (alice, bob, carol: one key set each) over the in-process TenantHFBackend (tiny
   model) and a replay buffer with one partition per tenant.
2. Each tenant's client is a plain ``OpenAI(base_url=..., api_key=<its key>)``; every reply's ``claas`` object names
   the tenant, the policy version and the SHA-256 of the adapter that served it.
3. Feedback lands in the giver's own partition; feedback on another tenant's request id is answered 404.
4. The admin key publishes a (random) adapter to alice and to bob, one tenant at a time; carol, who gives no
   feedback, stays at version 0 (the base model). With room for one adapter at a time, bob's evicts alice's, which
   is loaded again for her next request (never answered by the base model).
The adapters here are random stand-ins loaded by the admin key; a training job (``--config-name
claas/service_tenants``, examples/tenants_job_client.py) publishes each tenant's trained versions itself.
"""

from __future__ import annotations

import argparse
import tempfile

import httpx
import torch
from openai import OpenAI

from claas_verl.claas.replay.partitions import PartitionedReplay
from claas_verl.claas.service import ChatService, ServiceConfig, build_app
from claas_verl.claas.service.hf_tenants import TenantHFBackend
from claas_verl.claas.service.server import ServiceThread
from claas_verl.tiny import ensure_tiny
from claas_verl.tiny.adapters import random_lora_adapter

ADMIN = "sk-admin-demo"
KEYS = {"alice": "sk-alice-demo", "bob": "sk-bob-demo", "carol": "sk-carol-demo"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tiny = ensure_tiny()
    tmp = tempfile.mkdtemp(prefix="claas_tenants_")
    tenants = {t: {"api_keys": [k], "b_min": 2, "b_max": 16, "a_max": 4} for t, k in KEYS.items()}
    replay = PartitionedReplay(partitions={t: {k: c[k] for k in ("b_min", "b_max", "a_max")}
                                           for t, c in tenants.items()}, seed=0)
    backend = TenantHFBackend(tiny.student, list(KEYS), max_loaded_adapters=1, default_max_tokens=args.max_tokens)
    service = ChatService(backend, replay, config=ServiceConfig(tenants=tenants, admin_key=ADMIN, adapter_root=tmp))
    server = ServiceThread(build_app(service)).start()
    clients = {t: OpenAI(base_url=f"{server.url}/v1", api_key=k) for t, k in KEYS.items()}

    def ask(tenant: str, text: str):
        reply = clients[tenant].chat.completions.create(
            model="claas", messages=[{"role": "user", "content": text}], extra_body={"metadata": {"scenario_id": 0}})
        c = reply.model_extra["claas"]
        digest = (c["adapter_sha256"] or "base model")[:16]
        print(f"  {tenant:5s} v{c['policy_version']} adapter {digest:16s} -> {reply.choices[0].message.content!r}")
        return reply

    def feedback(tenant: str, request_id: str, reward: float) -> int:
        return httpx.post(f"{server.url}/v1/feedback", json={"request_id": request_id, "reward": reward},
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"}).status_code

    def publish(tenant: str, seed: int) -> None:
        path = f"{tmp}/{tenant}-{seed}"
        random_lora_adapter(tiny.student, path, seed=seed)  # stands in for a version the trainer publishes
        r = httpx.post(f"{server.url}/v1/claas/load_adapter", json={"lora_path": path, "tenant": tenant},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120).json()
        print(f"published {tenant} v{r['policy_version']} (sha256 {r['adapter_sha256'][:16]})")

    try:
        print("1. every tenant starts at version 0 (the base model)")
        first = {t: ask(t, "Say hello.") for t in KEYS}
        print("2. feedback goes to the giver's own partition; another tenant's request id is 404")
        print(f"  alice on her own turn: {feedback('alice', first['alice'].id, 1)}; "
              f"alice on bob's turn: {feedback('alice', first['bob'].id, 1)}; "
              f"bob on his own: {feedback('bob', first['bob'].id, 0)}")
        print("  partition sizes:", {t: len(replay.part(t)) for t in KEYS})
        print("3. new versions, one tenant at a time (carol gives no feedback and stays at v0)")
        publish("alice", 1)
        publish("bob", 2)
        for t in ("bob", "carol", "alice"):
            ask(t, "Name a colour.")
        print(f"  adapters loaded now: {backend.cache.loaded()}; cache counts: {backend.cache.counts}")
        own = httpx.get(f"{server.url}/v1/claas/stats", headers={"Authorization": f"Bearer {KEYS['alice']}"}).json()
        print(f"4. alice's stats see alice only: tenant={own['tenant']} v{own['policy_version']} "
              f"accepted={own['tenant_stats']['counts'].get('accepted', 0)} buffer={own['tenant_stats']['buffer']}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
