"""The reference path on a local Ray session: rows fetched from the object store, ownership adopted by the actor
(entries outlive their producer), memory returned after eviction, sampling from the consumer concurrency group.

One module-wide Ray session (the suite's ``ray_session``); each test checks several things to keep start-ups few.
"""

import time

import numpy as np
import pytest
import ray

from claas_verl.claas.replay import (
    EntryRef,
    PackedEntries,
    RefBatch,
    ReplayEntry,
    fetch_entries,
    make_replay_actor,
    put_batch,
    send_format,
)
from claas_verl.claas.replay.store import object_store_bytes_used


def _entries(tag, n, response_tokens=4, P=None):
    # token ids encode (entry, position) so a fetched row can be checked against its uid
    return [
        ReplayEntry(uid=f"{tag}-{i}", scenario_id=i, prompt_ids=[7, i], response_ids=np.full(response_tokens, i),
                    behaviour_logprob=-1.0, reward=1.0, P=P)
        for i in range(n)
    ]


def _wait(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_rows_come_from_the_object_store_and_outlive_their_producer(ray_session):
    @ray.remote(num_cpus=0)
    class _Producer:  # defined here so that Ray ships it by value (the test module is not importable in workers)
        def add(self, actor, tag, n):
            from claas_verl.claas.replay import ReplayEntry as Entry
            from claas_verl.claas.replay import put_batch as put

            entries = [Entry(uid=f"{tag}-{i}", scenario_id=i, prompt_ids=[7, i], response_ids=[i] * 4,
                             behaviour_logprob=-1.0, reward=1.0) for i in range(n)]
            return ray.get(actor.add.remote(put(entries)))

    actor = make_replay_actor(b_max=100, b_min=4, a_max=5, seed=0, max_restarts=0)
    plain = make_replay_actor(b_max=100, b_min=4, a_max=5, seed=0, max_restarts=0, adopt=False)
    producer = _Producer.remote()
    assert ray.get(producer.add.remote(actor, "p0", 6)) == 6
    assert ray.get(producer.add.remote(plain, "p1", 6)) == 6
    stats = ray.get(actor.stats.remote())
    assert stats["ref_batches"] == 1 and stats["stored_nbytes"] == 6 * (2 + 4) * 4
    _wait(lambda: ray.get(actor.stats.remote())["adopted_batches"] == 1, 30, "the actor never adopted the batch")

    got = ray.get(actor.sample_when_ready.remote(6, 30.0))
    assert all(isinstance(e, EntryRef) for e in got)  # metadata and a reference: no token crossed the actor
    full = fetch_entries(got)
    assert sorted(e.uid for e in full) == [f"p0-{i}" for i in range(6)]
    for e in full:
        i = int(e.uid.split("-")[1])
        assert e.prompt_ids.tolist() == [7, i] and e.response_ids.tolist() == [i] * 4 and e.P == 0
    assert fetch_entries(None) is None
    # what the CLaaS producer and the chat sink send: by reference to a Ray actor, by copy to an in-process stand-in
    assert isinstance(send_format(actor, _entries("x", 2)), RefBatch)
    assert isinstance(send_format(object(), _entries("x", 2)), PackedEntries)

    # The producer dies. The adopted batch is owned by the replay actor and stays readable; the batch left with its
    # producer (adopt=False) is lost with it: what adoption is for.
    ray.kill(producer)
    time.sleep(1.0)
    again = fetch_entries(ray.get(actor.sample.remote(6)))
    assert sorted(e.uid for e in again) == [f"p0-{i}" for i in range(6)]
    with pytest.raises(ray.exceptions.RayError):
        fetch_entries(ray.get(plain.sample.remote(6)))
    for a in (actor, plain):
        ray.kill(a)


def test_object_store_memory_returns_after_eviction(ray_session):
    actor = make_replay_actor(b_max=1000, b_min=1, a_max=1, seed=0, max_restarts=0)
    ray.get(actor.size.remote())
    time.sleep(1.0)
    baseline = object_store_bytes_used()
    n_batches, per_batch = 4, 10 * (2 + 25_000) * 4  # 4 batches of ~1 MB
    for b in range(n_batches):
        batch = put_batch(_entries(f"m{b}", 10, response_tokens=25_000))
        assert isinstance(batch, RefBatch) and ray.get(actor.add.remote(batch)) == 10
        del batch  # the producer keeps nothing
    _wait(lambda: ray.get(actor.stats.remote())["adopted_batches"] == n_batches, 30, "adoption did not finish")
    full = fetch_entries(ray.get(actor.sample.remote(8)))  # also waits for the adopted copies to exist
    assert all(e.n_tokens == 25_000 for e in full)
    del full
    _wait(lambda: object_store_bytes_used() - baseline < 1.5 * n_batches * per_batch, 30,
          "the producers' copies were not freed after adoption")
    held = object_store_bytes_used() - baseline
    assert held >= 0.9 * n_batches * per_batch, f"the store holds {held} B for {n_batches * per_batch} B of tokens"

    assert ray.get(actor.on_update.remote()) == 0
    assert ray.get(actor.on_update.remote()) == 40  # k - P = 2 > a_max: every entry evicted
    assert ray.get(actor.stats.remote())["ref_batches"] == 0
    _wait(lambda: object_store_bytes_used() - baseline < 0.1 * per_batch, 30,
          f"memory not returned after eviction: {object_store_bytes_used() - baseline} B still held")
    ray.kill(actor)


def test_concurrent_producers_and_consumer_keep_the_age_bound(ray_session):
    """Producer tasks add by reference while the consumer samples (consumer concurrency group), fetches the rows and
    calls on_update: every draw respects the age bound at the k it was drawn at (the consumer is the only caller of
    on_update), nothing is lost or duplicated."""
    a_max, n_prod, n_batches = 1, 3, 15
    actor = make_replay_actor(b_max=10_000, b_min=8, a_max=a_max, seed=0, max_restarts=0)

    @ray.remote(num_cpus=0)
    def produce(buffer, p):
        from claas_verl.claas.replay import ReplayEntry as Entry
        from claas_verl.claas.replay import put_batch as put

        n = 0
        for b in range(n_batches):
            entries = [Entry(uid=f"p{p}-b{b}-i{i}", scenario_id=p, prompt_ids=[p, b], response_ids=[i, 9],
                             behaviour_logprob=-1.0, reward=1.0) for i in range(10)]
            n += ray.get(buffer.add.remote(put(entries)))
        return n

    refs = [produce.remote(actor, p) for p in range(n_prod)]
    k = 0
    while len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
        got = ray.get(actor.sample_when_ready.remote(8, 2.0))
        if got is None:
            continue
        assert len({e.uid for e in got}) == 8 and all(k - e.P <= a_max for e in got)
        for e in fetch_entries(got):  # the rows behind each reference are the ones its uid names
            p, b, i = (int(x[1:]) for x in e.uid.split("-"))
            assert e.prompt_ids.tolist() == [p, b] and e.response_ids.tolist() == [i, 9]
        ray.get(actor.on_update.remote())
        k += 1
    assert sum(ray.get(refs)) == n_prod * n_batches * 10
    s = ray.get(actor.stats.remote())
    assert s["inserted"] == n_prod * n_batches * 10 and s["update_count"] == k >= 1
    assert s["max_age"] <= a_max and s["max_uses"] <= a_max + 1
    ray.kill(actor)


def test_an_adoption_in_flight_holds_no_thread_and_its_failure_is_counted(ray_session):
    """An adoption round waits on the event loop, never in a worker thread: a thread blocked in ``ray.get`` on a call
    that never completes kept a killed actor's process alive in CI (interpreter exit joins it), spinning a core."""
    @ray.remote(num_cpus=0)
    def unfinished():
        time.sleep(600)

    actor = make_replay_actor(b_max=100, b_min=1, a_max=5, seed=0, max_restarts=0)
    batch = put_batch(_entries("w", 2))
    pending = unfinished.remote()  # the adopter cannot run before its argument exists
    batch = RefBatch(handle=type(batch.handle)(pending, batch.handle.n_ids, batch.handle.node_id),
                     columns=batch.columns)
    assert ray.get(actor.add.remote(batch)) == 2

    def started(buffer):  # the round has taken the handle and submitted its adopter call
        return not buffer._to_adopt and not buffer._adopt_scheduled

    def executor_threads(buffer):
        import threading

        return sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncio_"))

    _wait(lambda: ray.get(actor.__ray_call__.remote(started)), 30, "the adoption round never started")
    time.sleep(0.5)
    assert ray.get(actor.__ray_call__.remote(executor_threads)) == []  # it waits with no thread
    assert ray.get(actor.stats.remote())["adopted_batches"] == 0

    ray.cancel(pending, force=True)  # the producer's object is lost: the adoption fails and is counted
    _wait(lambda: ray.get(actor.stats.remote())["adopt_errors"] == 1, 30, "the failed adoption was not counted")
    assert ray.get(actor.__ray_call__.remote(lambda buffer: len(buffer._adoptions))) == 0
    assert ray.get(actor.size.remote()) == 2  # the entries stay, held by the producer's references
    ray.kill(actor)
