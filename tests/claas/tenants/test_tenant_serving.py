"""Several tenants served at once: the adapter cache's per-tenant switches, eviction and on-demand reload (engine
callbacks recorded), then the same on the HF backend's PEFT model (the tiny student, real adapters)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tenant_adapters import far_adapter

from claas_verl.claas.tenants.serving import BASE, TenantAdapterCache


def _cache(capacity=2, tenants=("a", "b", "c")):
    calls = []
    cache = TenantAdapterCache(list(tenants), capacity, load=lambda n, p: calls.append(("load", n, p)),
                               unload=lambda n: calls.append(("unload", n)))
    return cache, calls


def _publish(cache, tenant, version):
    cache.stage(tenant, version, f"/adapters/{tenant}/{version}")
    cache.commit(tenant, version)


def test_an_evicted_adapter_is_loaded_again_for_its_tenants_next_request():
    cache, calls = _cache()
    assert cache.served("a") == (BASE, 0)
    with cache.acquire("a") as lease:  # version 0 is the base model: nothing to load
        assert (lease.name, lease.version) == (BASE, 0)
    _publish(cache, "a", 1)
    _publish(cache, "b", 1)
    _publish(cache, "c", 1)  # third adapter, capacity 2: a's (least recently used) goes
    assert cache.loaded() == ["b@v1", "c@v1"] and ("unload", "a@v1") in calls
    with cache.acquire("a") as lease:
        assert (lease.name, lease.version) == ("a@v1", 1)  # a's adapter again, never the base model
    assert calls[-2:] == [("unload", "b@v1"), ("load", "a@v1", "/adapters/a/1")]
    assert cache.loaded() == ["c@v1", "a@v1"]
    assert (cache.counts["loads"], cache.counts["reloads"], cache.counts["evictions"]) == (3, 1, 2)


def test_each_tenant_keeps_its_own_versioned_switch():
    cache, calls = _cache(capacity=3)
    _publish(cache, "a", 1)
    _publish(cache, "b", 1)
    running = cache.acquire("a")  # a request of a started on v1
    _publish(cache, "a", 2)
    assert cache.served("a") == ("a@v2", 2) and cache.served("b") == ("b@v1", 1)
    assert "a@v1" in cache.loaded() and running.version == 1  # kept until its request ends
    running.release()
    assert "a@v1" not in cache.loaded() and calls[-1] == ("unload", "a@v1")
    with pytest.raises(ValueError, match="tenant 'b' serves v1; a reload must bring a later version"):
        cache.stage("b", 1, "/x")
    cache.stage("b", 2, "/adapters/b/2")
    cache.discard("b", 2)  # a failed verification: b keeps v1
    assert cache.served("b") == ("b@v1", 1) and "b@v2" not in cache.loaded()
    with pytest.raises(ValueError, match="b@v3 was not staged"):
        cache.commit("b", 3)
    with pytest.raises(ValueError, match="no tenant 'z'"):
        cache.acquire("z")


def test_a_full_cache_of_running_adapters_goes_over_capacity_rather_than_refuse():
    cache, _ = _cache(capacity=1, tenants=("a", "b"))
    _publish(cache, "a", 1)
    _publish(cache, "b", 1)  # evicts a@v1 (idle)
    with cache.acquire("b"):
        with cache.acquire("a") as lease:  # b's adapter is running: a's is loaded beside it
            assert lease.name == "a@v1"
    assert cache.counts["over_capacity"] == 1
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        TenantAdapterCache(["a"], 0, load=print, unload=print)




def test_the_hf_backend_serves_every_tenants_version_and_reloads_an_evicted_one(tiny, tmp_path):
    from claas_verl.claas.service.backend import AdapterRejected
    from claas_verl.claas.service.hf_tenants import TenantHFBackend
    from claas_verl.claas.service.sampling import SamplingParams
    from claas_verl.claas.tenants.verify import ReloadProbe, probe_ids, probe_token_logprobs

    torch.set_num_threads(1)
    adapters = {t: far_adapter(tiny, tmp_path / t, seed) for seed, t in enumerate(("a", "b", "c"), 1)}
    backend = TenantHFBackend(tiny.student, ["a", "b", "c", "idle"], max_loaded_adapters=2, default_max_tokens=4)
    ids = probe_ids(backend.tokenizer, 10)
    base = probe_token_logprobs(backend.model, ids)
    trained = {t: probe_token_logprobs(model, ids) for t, (_, model) in adapters.items()}

    def close(x, y):
        return max(abs(u - v) for u, v in zip(x, y)) < 1e-5

    async def main():
        for t, (path, _) in adapters.items():
            assert await backend.load_adapter(path, tenant=t) == 1
        assert backend.cache.loaded() == ["b@v1", "c@v1"]  # a's adapter was evicted for c's
        for t in ("a", "b", "c", "a"):  # a first: loaded again on demand
            assert close(backend.score_probe(ids, t), trained[t]), t
        assert close(backend.score_probe(ids, "idle"), base)  # a tenant at version 0: the base model
        assert backend.cache.counts["reloads"] >= 2  # a, then b after a pushed it out
        msgs = [{"role": "user", "content": "hi"}]
        gen = await backend.generate(msgs, SamplingParams(max_tokens=3, seed=0), tenant="b")
        assert (gen.policy_version, gen.model) == (1, "claas-hf-b-v1")
        with pytest.raises(ValueError, match="needs the request's tenant"):
            await backend.generate(msgs, SamplingParams(max_tokens=3), tenant=None)
        # a verified reload of b that is not what the trainer trained: b keeps v1, the others are untouched
        probe = ReloadProbe(ids, lambda served: close(served, trained["b"]))
        with pytest.raises(AdapterRejected, match="tenant 'b': the adapter loaded as v2 failed"):
            await backend.load_adapter(adapters["c"][0], probe=probe, tenant="b")
        assert backend.served_version("b") == 1 and close(backend.score_probe(ids, "b"), trained["b"])
        assert await backend.load_adapter(adapters["b"][0], probe=probe, tenant="b") == 2  # the right file
        assert backend.served_version("b") == 2 and backend.policy_version == 2
        assert close(backend.score_probe(ids, "a"), trained["a"]) and close(backend.score_probe(ids, "c"),
                                                                             trained["c"])

    asyncio.run(main())
    assert not close(base, trained["a"])  # the adapters are far from the base model: the checks above can fail
