"""Tenants with real parts over real HTTP: the HF backend serving each tenant's own adapter (an evicted one loaded
again on demand, never the base model; the reply's digest is the adapter file's), and a Ray replay actor built with
one partition per tenant behind the service's actor sinks."""

from __future__ import annotations

import httpx
import ray
import torch
from service_helpers import ADMIN, USER, recompute_token_logprobs, running_service
from tenant_helpers import BOB, TENANTS, TenantScripted, auth, chat, feedback, partitions

from claas_verl.claas.replay import ReplayBufferActor
from claas_verl.claas.service.sinks import ActorSink, make_sink
from claas_verl.claas.tenants.adapters import adapter_file_digest
from claas_verl.tiny.adapters import random_lora_adapter

KEYS = {"a": "sk-a", "b": "sk-b", "c": "sk-c"}


def _adapter(tiny, out, seed):
    # far from the base model (lora_B ×20), so a reply of the base model cannot pass for the adapter's
    return random_lora_adapter(tiny.student, out, seed=seed, b_scale=20.0)


def test_each_tenant_is_served_its_own_adapter_and_an_evicted_one_comes_back(tiny, tmp_path):
    from claas_verl.claas.service.hf_tenants import TenantHFBackend

    torch.set_num_threads(1)
    tenants = {t: {"api_keys": [k], "b_min": 1, "b_max": 8, "a_max": 100} for t, k in KEYS.items()}
    models = {t: _adapter(tiny, tmp_path / t, seed) for seed, t in enumerate(KEYS, 1)}
    backend = TenantHFBackend(tiny.student, list(KEYS), max_loaded_adapters=2, default_max_tokens=6, seed=0)
    with running_service(backend, partitions(tenants), tenants=tenants, adapter_root=str(tmp_path)) as (_, url):
        for t in KEYS:  # c's load evicts a's adapter (two at once)
            r = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": str(tmp_path / t), "tenant": t},
                           headers=auth(ADMIN), timeout=60)
            assert r.status_code == 200 and r.json()["adapter_sha256"] == adapter_file_digest(tmp_path / t)
        assert backend.cache.loaded() == ["b@v1", "c@v1"]
        for t in ("a", "b", "c"):
            reply = chat(url, KEYS[t], logprobs=True, metadata={"scenario_id": 1}).json()
            claas = reply["claas"]
            assert (claas["tenant"], claas["policy_version"]) == (t, 1)
            assert claas["adapter_sha256"] == adapter_file_digest(tmp_path / t)
            served = [x["logprob"] for x in reply["choices"][0]["logprobs"]["content"]]
            ids = [int(x["token"].split(":")[1]) for x in reply["choices"][0]["logprobs"]["content"]]
            prompt = backend._prepare(USER, _params(), None)[0]
            expect = recompute_token_logprobs(models[t], prompt, ids)  # the tenant's own adapter, not the base
            assert max(abs(u - v) for u, v in zip(served, expect)) < 1e-4, t
        assert backend.cache.counts["reloads"] >= 1  # a's adapter was loaded again for its request
        models = httpx.get(f"{url}/v1/models", headers=auth(KEYS["a"])).json()["data"]
        assert [m["id"] for m in models] == ["claas-hf", "claas-hf-a-v1"]  # its own served model, no other tenant's
        admin = httpx.get(f"{url}/v1/models", headers=auth(ADMIN)).json()["data"]
        assert {m["id"] for m in admin} == {"claas-hf", "claas-hf-a-v1", "claas-hf-b-v1", "claas-hf-c-v1"}


def _params():
    from claas_verl.claas.service.sampling import SamplingParams

    return SamplingParams(max_tokens=6)


def test_a_partitioned_replay_actor_takes_each_tenants_feedback_in_its_own_partition(ray_session):
    parts = {t: {k: c[k] for k in ("b_min", "b_max", "a_max")} for t, c in TENANTS.items()}
    actor = ReplayBufferActor.remote(partitions=parts, seed=0)
    sink = ActorSink(actor)
    assert make_sink(sink, "bob").tenant == "bob" and isinstance(make_sink(actor, "bob"), ActorSink)
    with running_service(TenantScripted(TENANTS), actor, tenants=TENANTS) as (service, url):
        rid = chat(url, BOB).json()["id"]
        assert feedback(url, rid, 1, BOB).json()["status"] == "accepted"
        assert ray.get(actor.size.remote(tenant="bob")) == 1 and ray.get(actor.size.remote(tenant="alice")) == 0
        assert [e.uid for e in ray.get(actor.entries.remote(tenant="bob"))] == [rid]
        stats = httpx.get(f"{url}/v1/claas/stats", headers=auth(BOB)).json()
        assert stats["tenant_stats"]["buffer"] == {"size": 1, "b_max": 8}
        assert httpx.get(f"{url}/health").status_code == 200
