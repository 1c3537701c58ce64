"""One replay partition per tenant: sizes, FIFO, age clocks and draws of one tenant never touch another's.

The plain class first (no Ray), then the same on a real local Ray actor: adds, evictions, ``on_update`` and
samples through ``tenant=``, readiness waits per tenant and for any tenant, and a snapshot that restores every
partition exactly (its next draws included).
"""

from __future__ import annotations

import asyncio

import pytest

from claas_verl.claas.replay import AsyncReplayBuffer, ReplayEntry
from claas_verl.claas.replay.partitions import PartitionedReplay, partition_seed

SIZES = {"alice": {"b_min": 2, "b_max": 3, "a_max": 1}, "bob": {"b_min": 1, "b_max": 10, "a_max": 0}}


def _entry(uid, P=None):
    return ReplayEntry(uid=uid, scenario_id=0, prompt_ids=[1], response_ids=[2, 3], behaviour_logprob=-0.2,
                       reward=1.0, P=P)


def test_each_partition_keeps_its_own_sizes_fifo_and_age_clock():
    r = PartitionedReplay(seed=0, partitions=SIZES)
    a, b = r.part("alice"), r.part("bob")
    assert (a.b_min, a.b_max, a.a_max, b.b_min, b.b_max, b.a_max) == (2, 3, 1, 1, 10, 0)
    b.add(_entry("b0"))
    bob_before = b.state_dict()
    assert a.add([_entry(f"a{i}") for i in range(5)]) == 5
    assert [e.uid for e in a.entries()] == ["a2", "a3", "a4"]  # alice's FIFO at her b_max = 3
    a.on_update()
    a.on_update()  # alice's k = 2: her entries (P = 0) are 2 > a_max = 1 updates old
    assert len(a) == 0 and a.update_count == 2
    assert b.state_dict() == bob_before  # bob's entries, k, counters and RNG untouched
    assert r.ready_tenants() == ["bob"] and r.total_size() == 1


def test_a_tenants_draws_do_not_depend_on_another_tenants_traffic():
    alone = PartitionedReplay(seed=7, partitions={"alice": SIZES["alice"]})
    shared = PartitionedReplay(seed=7, partitions=SIZES)
    draws = {}
    for name, r in (("alone", alone), ("shared", shared)):
        seq = []
        for step in range(6):
            r.part("alice").add([_entry(f"a{step}-{i}") for i in range(3)])
            if name == "shared":  # bob's adds, samples and updates in between
                r.part("bob").add([_entry(f"b{step}-{i}") for i in range(4)])
                r.part("bob").sample(2)
                r.part("bob").on_update()
            seq.append([e.uid for e in r.part("alice").sample(2)])
            r.part("alice").on_update()
        draws[name] = seq
    assert draws["alone"] == draws["shared"]
    assert partition_seed(7, "alice") != partition_seed(7, "bob") and partition_seed(None, "alice") is None


def test_bad_partitions_and_a_missing_tenant_are_refused_by_name():
    with pytest.raises(ValueError, match="either b_max/b_min/a_max .* or partitions"):
        PartitionedReplay(4, 2, 1, partitions=SIZES)
    with pytest.raises(ValueError, match="needs b_max, b_min and a_max"):
        PartitionedReplay()
    with pytest.raises(ValueError, match=r"replay partition 'x': needs exactly .* missing \['a_max'\]"):
        PartitionedReplay(partitions={"x": {"b_min": 1, "b_max": 2}})
    with pytest.raises(ValueError, match=r"replay partition 'x': b_max must be an int >= b_min"):
        PartitionedReplay(partitions={"x": {"b_min": 3, "b_max": 2, "a_max": 0}})
    r = PartitionedReplay(partitions=SIZES)
    with pytest.raises(ValueError, match=r"partitioned by tenant \['alice', 'bob'\]: name the tenant"):
        r.part(None)
    with pytest.raises(ValueError, match="no replay partition for tenant 'carol'"):
        r.part("carol")
    with pytest.raises(ValueError, match="the state holds tenants"):
        r.load_state_dict(PartitionedReplay(partitions={"alice": SIZES["alice"]}).state_dict())
    with pytest.raises(ValueError, match="single buffer's but this replay actor is partitioned"):
        r.load_state_dict(PartitionedReplay(3, 1, 1).state_dict())
    with pytest.raises(ValueError, match="partitioned by tenant but this replay actor has one implicit"):
        PartitionedReplay(3, 1, 1).load_state_dict(r.state_dict())


def test_the_async_actor_body_wakes_a_tenants_waiter_only_for_its_own_partition():
    async def main():
        buf = AsyncReplayBuffer(partitions=SIZES, seed=0)
        bob_waits = asyncio.create_task(buf.wait_ready(5.0, tenant="bob"))
        alice_waits = asyncio.create_task(buf.wait_ready(5.0, tenant="alice"))
        await asyncio.sleep(0.05)
        await buf.add([_entry("a0")], tenant="alice")  # below alice's b_min = 2; bob's partition is still empty
        await asyncio.sleep(0.05)
        assert not bob_waits.done() and not alice_waits.done()
        await buf.add([_entry("b0")], tenant="bob")
        assert await asyncio.wait_for(bob_waits, 1.0) is True
        assert not alice_waits.done()
        assert await buf.wait_any_ready(0.01) == ["bob"]
        await buf.add([_entry("a1")], tenant="alice")
        assert await asyncio.wait_for(alice_waits, 1.0) is True
        assert await buf.sample_when_ready(1, 1.0, tenant="bob") is not None
        alice_only = await buf.sample(2, tenant="alice")
        assert sorted(e.uid for e in alice_only) == ["a0", "a1"]

    asyncio.run(main())


def test_partitions_on_a_ray_actor_stay_apart_and_resume_exactly(ray_session, tmp_path):
    import ray

    from claas_verl.claas.replay import make_replay_actor

    snap = str(tmp_path / "replay.pkl")
    actor = make_replay_actor(partitions=SIZES, seed=3, snapshot_path=snap, max_restarts=0)
    with pytest.raises(ValueError, match="either b_max/b_min/a_max"):
        make_replay_actor(4, 2, 1, partitions=SIZES)
    assert ray.get(actor.tenants.remote()) == ["alice", "bob"]
    assert ray.get(actor.wait_any_ready.remote(0.05)) == []
    assert ray.get(actor.add.remote([_entry(f"a{i}") for i in range(5)], tenant="alice")) == 5
    assert ray.get(actor.add.remote([_entry(f"b{i}") for i in range(6)], tenant="bob")) == 6
    # alice's FIFO dropped two of hers; bob holds all six
    assert ray.get(actor.size.remote(tenant="alice")) == 3 and ray.get(actor.size.remote(tenant="bob")) == 6
    assert ray.get(actor.wait_any_ready.remote(1.0)) == ["alice", "bob"]
    for _ in range(5):  # mini-batches are one tenant's only
        assert all(e.uid.startswith("b") for e in ray.get(actor.sample.remote(4, tenant="bob")))
        assert all(e.uid.startswith("a") for e in ray.get(actor.sample.remote(3, tenant="alice")))
    # bob's update ages only bob's entries (a_max = 0: all of them); alice's clock does not move
    assert ray.get(actor.on_update.remote(tenant="bob")) == 6
    assert ray.get(actor.update_count.remote(tenant="bob")) == 1
    assert ray.get(actor.update_count.remote(tenant="alice")) == 0
    assert ray.get(actor.summary.remote(tenant="alice"))["uids"] == ["a2", "a3", "a4"]
    stats = ray.get(actor.stats.remote())
    assert stats["size"] == 3 and stats["tenants"]["bob"]["evicted_age"] == 6
    assert stats["tenants"]["alice"]["evicted_fifo"] == 2 and stats["tenants"]["alice"]["evicted_age"] == 0
    assert ray.get(actor.stats.remote(tenant="alice"))["b_max"] == 3
    with pytest.raises(ray.exceptions.RayTaskError, match="name the tenant"):
        ray.get(actor.sample.remote(1))
    with pytest.raises(ray.exceptions.RayTaskError, match="no replay partition for tenant 'eve'"):
        ray.get(actor.add.remote([_entry("e0")], tenant="eve"))
    ray.get(actor.add.remote([_entry("b-late")], tenant="bob"))

    ray.get(actor.save.remote())
    restored = make_replay_actor(partitions=SIZES, seed=99, snapshot_path=snap, max_restarts=0)
    for tenant in ("alice", "bob"):
        assert ray.get(restored.summary.remote(tenant=tenant)) == ray.get(actor.summary.remote(tenant=tenant))
    # the RNG states came back too: both actors draw the same next mini-batches
    for _ in range(3):
        assert [e.uid for e in ray.get(restored.sample.remote(2, tenant="alice"))] == \
            [e.uid for e in ray.get(actor.sample.remote(2, tenant="alice"))]
    for a in (actor, restored):
        ray.kill(a)
