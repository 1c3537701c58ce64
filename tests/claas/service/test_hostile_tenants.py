"""Tenants against each other, over real HTTP on 127.0.0.1 (uvicorn, real sockets): a tenant cannot read, give
feedback on, evict or slow another tenant's work beyond its own quota. The backend is scripted (no model)."""

from __future__ import annotations

import threading

import httpx
from service_helpers import ADMIN, running_service, wait_until
from tenant_helpers import ALICE, ALICE_2, BOB, TENANTS, TenantScripted, auth, chat, feedback, partitions

from claas_verl.claas.service.guard import key_id


def _tenants(**alice):
    return {"alice": {**TENANTS["alice"], **alice}, "bob": dict(TENANTS["bob"])}


def test_feedback_on_another_tenants_turn_is_404_and_leaves_it_untouched():
    replay = partitions()
    with running_service(TenantScripted(TENANTS), replay, tenants=TENANTS) as (_, url):
        rid = chat(url, BOB).json()["id"]
        for key in (ALICE, ALICE_2):
            stolen = feedback(url, rid, 1, key)
            assert stolen.status_code == 404 and stolen.json()["status"] == "unknown"  # not told the turn exists
        assert len(replay.part("alice")) == 0 and len(replay.part("bob")) == 0
        assert feedback(url, rid, 0, BOB).json()["status"] == "accepted"  # still pending for its owner
        assert [(e.uid, e.reward) for e in replay.part("bob").entries()] == [(rid, 0.0)]


def test_flooding_ones_own_pending_quota_never_evicts_another_tenants_turns():
    tenants = _tenants(max_pending=3)
    with running_service(TenantScripted(tenants), partitions(tenants), tenants=tenants, max_pending=4,
                         max_pending_per_key=4) as (service, url):
        bob = chat(url, BOB).json()["id"]
        alice = [chat(url, ALICE).json()["id"] for _ in range(10)]
        alice_ledger = service.ledger("alice").recorder
        assert sum(alice_ledger.is_pending(r) for r in alice) == 3  # alice's quota: her oldest went
        assert alice_ledger.stats()["dropped_overflow"] == 7
        assert service.ledger("bob").recorder.is_pending(bob)
        assert service.ledger("bob").recorder.stats()["dropped_overflow"] == 0
        assert feedback(url, bob, 1, BOB).json()["status"] == "accepted"


def test_a_full_partition_of_one_tenant_never_pushes_out_another_tenants_entries():
    replay = partitions()
    with running_service(TenantScripted(TENANTS), replay, tenants=TENANTS) as (_, url):
        bob = chat(url, BOB).json()["id"]
        assert feedback(url, bob, 1, BOB).json()["status"] == "accepted"
        for _ in range(20):  # alice's partition holds 8: its FIFO turns over 2.5 times
            rid = chat(url, ALICE).json()["id"]
            assert feedback(url, rid, 1, ALICE).json()["status"] == "accepted"
        assert len(replay.part("alice")) == 8 and [e.uid for e in replay.part("bob").entries()] == [bob]


def test_a_tenant_over_its_rate_limit_is_refused_while_the_other_is_served():
    tenants = _tenants(rate_limit_per_s=0.01, rate_limit_burst=3)
    with running_service(TenantScripted(tenants), partitions(tenants), tenants=tenants) as (service, url):
        codes = [chat(url, key).status_code for key in (ALICE, ALICE_2, ALICE, ALICE_2, ALICE)]
        assert codes == [200, 200, 200, 429, 429]  # the tenant's bucket spans all its keys
        r = chat(url, ALICE)
        assert r.status_code == 429 and "tenant 'alice' is over its rate limit" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
        assert [chat(url, BOB).status_code for _ in range(6)] == [200] * 6  # bob has no limit and is untouched
        assert service.ledger("alice").recorder.stats()["rate_limited"] == 3
        assert service.ledger("bob").recorder.stats()["rate_limited"] == 0


def test_a_tenant_whose_grading_queue_is_full_does_not_slow_the_other():
    release, seen = threading.Event(), []

    def grader(request):  # alice's gradings hang until released; bob's are graded at once
        seen.append(request.response_text)
        if request.response_text == "hi alice":
            release.wait(30)
        return 1.0

    replay = partitions()
    with running_service(TenantScripted(TENANTS), replay, grader=grader, tenants=TENANTS, max_grading=2) \
            as (service, url):
        assert [chat(url, ALICE).json()["claas"]["record"] for _ in range(2)] == ["grading", "grading"]
        busy = chat(url, ALICE)
        assert busy.status_code == 429  # alice's own queue is full
        for i in range(4):  # bob's own queue (max_grading=2 per tenant) is free: each chat is served and graded
            assert chat(url, BOB).json()["claas"]["record"] == "grading"
            wait_until(lambda n=i + 1: len(replay.part("bob")) == n,
                       lambda: f"bob's entries: {len(replay.part('bob'))}")
        assert len(replay.part("alice")) == 0
        release.set()
        wait_until(lambda: len(replay.part("alice")) == 2, "alice's two gradings")


def test_stats_and_metrics_never_leak_another_tenant():
    with running_service(TenantScripted(TENANTS), partitions(), tenants=TENANTS) as (_, url):
        bob_rid = chat(url, BOB).json()["id"]
        feedback(url, chat(url, ALICE).json()["id"], 1, ALICE)
        body = httpx.get(f"{url}/v1/claas/stats", headers=auth(ALICE)).text
        for secret in ("bob", key_id(BOB), bob_rid, BOB):
            assert secret not in body, secret
        assert '"tenant":"alice"' in body.replace(" ", "")
        for key in (ALICE, BOB):  # per-tenant metrics are the operator's
            assert httpx.get(f"{url}/metrics", headers=auth(key)).status_code == 401
        assert httpx.get(f"{url}/v1/claas/stats", headers=auth("sk-nobody")).status_code == 401
        assert key_id(BOB) in httpx.get(f"{url}/v1/claas/stats", headers=auth(ADMIN)).text


def test_a_tenant_cannot_reload_or_evict_another_tenants_adapter():
    backend = TenantScripted(TENANTS)
    with running_service(backend, partitions(), tenants=TENANTS) as (service, url):
        for key in (ALICE, BOB):
            r = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": service.config.adapter_root,
                                                                 "tenant": "bob"}, headers=auth(key))
            assert r.status_code == 401
        assert backend.versions == {"alice": 0, "bob": 0}
        assert chat(url, BOB).json()["claas"]["policy_version"] == 0


def test_the_buffer_share_holds_between_the_keys_of_one_tenant_only():
    tenants = {"alice": {**TENANTS["alice"], "b_max": 4, "max_buffer_share": 0.5}, "bob": dict(TENANTS["bob"])}
    replay = partitions(tenants)
    with running_service(TenantScripted(tenants), replay, tenants=tenants) as (_, url):
        assert feedback(url, chat(url, ALICE).json()["id"], 1, ALICE).json()["status"] == "accepted"
        for _ in range(3):  # alice's second key fills the rest of her partition (free space is usable)
            assert feedback(url, chat(url, ALICE_2).json()["id"], 1, ALICE_2).json()["status"] == "accepted"
        # ALICE_2 holds 3 of 4 > her share of 2: her next entry would push ALICE's out of their partition
        refused = feedback(url, chat(url, ALICE_2).json()["id"], 1, ALICE_2)
        assert refused.status_code == 429 and "share of the replay buffer" in refused.json()["error"]["message"]
        for _ in range(6):  # bob's partition is his own: alice's share never limits him
            assert feedback(url, chat(url, BOB).json()["id"], 1, BOB).json()["status"] == "accepted"
