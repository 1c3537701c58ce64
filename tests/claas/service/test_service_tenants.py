"""Tenants in the chat service: the ``tenants`` configuration (its key rule, field-named errors) and each key's
requests routed to its tenant over real HTTP (uvicorn on 127.0.0.1): its backend slot, its replay partition, its
adapter version and digest in every reply, its own stats and per-tenant metrics."""

from __future__ import annotations

import httpx
import pytest
from service_helpers import ADMIN, USER, Scripted, big_buffer, running_service
from tenant_helpers import ALICE, ALICE_2, BOB, TENANTS, TenantScripted, auth, chat, feedback, partitions

from claas_verl.claas.service import ServiceConfig
from claas_verl.claas.service.sinks import make_sink
from claas_verl.claas.tenants.config import DEFAULT_TENANT


# ---------------------------------------------------------------------------------------------- configuration
def test_tenants_build_the_directory_and_every_tenant_key_is_accepted():
    cfg = ServiceConfig(tenants=TENANTS)
    assert cfg.directory.names == ("alice", "bob") and cfg.directory.tenant_of(ALICE_2) == "alice"
    assert set(cfg.accepted_keys) == {ALICE, ALICE_2, BOB} and cfg.api_keys == ()
    plain = ServiceConfig(api_keys=("k",))
    assert plain.directory.implicit and plain.directory.tenant_of("k") == DEFAULT_TENANT


@pytest.mark.parametrize("extra, match", [
    ({"api_keys": (ALICE,)}, r"api_keys: 1 key\(s\) also listed under tenants.<t>.api_keys"),
    ({"api_keys": ("sk-other",)}, "api_keys must be empty when tenants is set"),
    ({"admin_key": BOB}, "admin_key is also a key of tenant 'bob'"),
    ({"allow_keyless": True}, "allow_keyless cannot be combined with tenants"),
    ({"max_buffer_share": 0.5}, r"set tenants.<t>.max_buffer_share instead"),
])
def test_the_key_rule_is_refused_by_field(extra, match):
    with pytest.raises(ValueError, match=match):
        ServiceConfig(tenants=TENANTS, **extra)


def test_a_bad_tenant_field_is_named_with_its_yaml_path():
    from claas_verl.claas.trainer.config import ServiceSection

    bad = {"alice": {"api_keys": [ALICE], "b_min": 0}}
    with pytest.raises(ValueError, match=r"claas\.service\.tenants\.alice\.b_min must be an int >= 1"):
        ServiceSection(tenants=bad)
    with pytest.raises(ValueError, match=r"claas\.service\.tenants\.bob: unknown key\(s\) \['quota'\]"):
        ServiceSection(tenants={"bob": {"api_keys": [BOB], "quota": 3}})
    # a training job trains one adapter per tenant (claas/service_tenants); the section names them in order
    assert ServiceSection(tenants=TENANTS).tenant_names == tuple(TENANTS)


def test_a_multi_tenant_service_refuses_a_buffer_or_a_backend_every_tenant_would_share():
    from claas_verl.claas.service import ChatService

    with pytest.raises(ValueError, match="needs a replay sink partitioned by tenant"):
        make_sink(big_buffer(), tenant="alice")
    with pytest.raises(ValueError, match="needs a replay sink partitioned by tenant"):
        ChatService(TenantScripted(TENANTS), big_buffer(), config=ServiceConfig(tenants=TENANTS))
    with pytest.raises(ValueError, match="Scripted serves one adapter to every key"):
        ChatService(Scripted(), partitions(), config=ServiceConfig(tenants=TENANTS))
    with pytest.raises(ValueError, match=r"tenants.bob: the backend does not serve this tenant"):
        ChatService(TenantScripted({"alice": 0}), partitions(), config=ServiceConfig(tenants=TENANTS))


# ---------------------------------------------------------------------------------------------- routing over HTTP
def test_each_key_is_served_recorded_and_trained_in_its_own_tenant():
    backend, replay = TenantScripted(TENANTS), partitions()
    with running_service(backend, replay, tenants=TENANTS) as (service, url):
        a = chat(url, ALICE).json()
        b = chat(url, BOB).json()
        assert (a["claas"]["tenant"], b["claas"]["tenant"]) == ("alice", "bob")
        assert backend.seen == ["alice", "bob"]
        assert a["claas"]["policy_version"] == 0 and a["claas"]["adapter_sha256"] is None  # the base model
        assert feedback(url, a["id"], 1, ALICE).json()["status"] == "accepted"
        assert feedback(url, b["id"], 0, BOB).json()["status"] == "accepted"
        assert [(e.uid, e.metadata["tenant"]) for e in replay.part("alice").entries()] == [(a["id"], "alice")]
        assert [(e.uid, e.reward) for e in replay.part("bob").entries()] == [(b["id"], 0.0)]

        # a reload of bob's adapter changes bob's replies only
        tmp = service.config.adapter_root
        r = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": tmp, "tenant": "bob"}, headers=auth(ADMIN))
        assert r.status_code == 200 and r.json()["tenant"] == "bob" and r.json()["policy_version"] == 1
        digest = backend.digests[("bob", 1)]
        assert r.json()["adapter_sha256"] == digest
        b2, a2 = chat(url, BOB).json()["claas"], chat(url, ALICE_2).json()["claas"]
        assert (b2["tenant"], b2["policy_version"], b2["adapter_sha256"]) == ("bob", 1, digest)
        assert (a2["tenant"], a2["policy_version"], a2["adapter_sha256"]) == ("alice", 0, None)
        no_tenant = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": tmp}, headers=auth(ADMIN))
        assert no_tenant.status_code == 400 and "'tenant' must name the tenant" in no_tenant.json()["error"]["message"]

        # streaming replies name the tenant too, in every chunk
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={"messages": USER, "stream": True},
                          headers=auth(BOB), timeout=30) as s:
            chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all('"tenant": "bob"' in c for c in chunks) and digest in chunks[-1]

        # stats: a key sees its own tenant (version, digest, counts); the admin sees every tenant
        own = httpx.get(f"{url}/v1/claas/stats", headers=auth(BOB)).json()
        assert own["tenant"] == "bob" and own["policy_version"] == 1 and own["adapter_sha256"] == digest
        assert own["tenant_stats"]["counts"]["accepted"] == 1 and own["tenant_stats"]["buffer"] == {"size": 1,
                                                                                                    "b_max": 8}
        admin = httpx.get(f"{url}/v1/claas/stats", headers=auth(ADMIN)).json()
        assert {t: (v["policy_version"], v["adapter_sha256"]) for t, v in admin["tenants"].items()} == {
            "alice": (0, None), "bob": (1, digest)}
        assert admin["accepted"] == 2 and admin["served"] == 5

        metrics = httpx.get(f"{url}/metrics", headers=auth(ADMIN)).text
        assert 'claas_tenant_turns_total{outcome="accepted",tenant="alice"} 1.0' in metrics
        assert 'claas_tenant_policy_version{tenant="bob"} 1.0' in metrics
        # the admin key reads and reloads every tenant, but chats as none
        refused = chat(url, ADMIN)
        assert refused.status_code == 403 and "belongs to no tenant" in refused.json()["error"]["message"]


def test_a_single_tenant_service_names_its_implicit_tenant():
    with running_service(Scripted(), big_buffer(), api_keys=("k",)) as (_, url):
        c = chat(url, "k").json()["claas"]
        assert c["tenant"] == DEFAULT_TENANT and c["policy_version"] == 0 and "adapter_sha256" in c
        assert httpx.get(f"{url}/v1/claas/stats", headers=auth("k")).json()["tenant"] == DEFAULT_TENANT
