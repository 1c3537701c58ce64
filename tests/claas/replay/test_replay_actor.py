"""ReplayBufferActor on a local Ray session: concurrency, blocking readiness, bad input, snapshots, kill + restart.

One Ray session is shared by the whole module (starting Ray and importing claas_verl in each worker dominates the
run time), so the tests here are few and each checks several things.
"""

import os
import time

import pytest
import ray

from claas_verl.claas.replay import (
    PackedEntries,
    ReplayBufferActor,
    ReplayEntry,
    load_snapshot,
    make_replay_actor,
    put_batch,
)


def _entry(uid, P=None, reward=1.0):
    return ReplayEntry(
        uid=uid, scenario_id=0, prompt_ids=[1, 2, 3], response_ids=[4, 5], behaviour_logprob=-0.3, reward=reward, P=P
    )


def test_concurrent_producers_and_consumer_lose_and_duplicate_nothing(ray_session):
    n_producers, n_batches, batch_size = 4, 8, 5
    actor = ReplayBufferActor.remote(b_max=10_000, b_min=20, a_max=1_000, seed=0)

    # Started before anything is added: must block (not fail, not spin) until b_min = 20 entries arrive.
    ready_ref = actor.wait_ready.remote(300.0)  # generous: worker start-up is slow on a loaded machine
    assert ray.get(actor.wait_ready.remote(0.05)) is False  # a short timeout returns False

    @ray.remote(num_cpus=1)
    def produce(buffer, producer_id):
        from claas_verl.claas.replay import PackedEntries
        from claas_verl.claas.replay import ReplayEntry as Entry

        accepted = 0
        for b in range(n_batches):
            batch = [
                Entry(
                    uid=f"p{producer_id}-b{b}-{i}",
                    scenario_id=producer_id,
                    prompt_ids=[1, 2],
                    response_ids=[3, 4, b],
                    behaviour_logprob=-1.0,
                    reward=float(i % 2),
                )
                for i in range(batch_size)
            ]
            if producer_id % 2:  # odd producers send the columnar wire format, even ones lists of entries
                batch = PackedEntries.from_entries(batch)
            accepted += ray.get(buffer.add.remote(batch))
            if b == 0:
                accepted += ray.get(buffer.add.remote(batch))  # a retried add: every uid is skipped
        return accepted

    producer_refs = [produce.remote(actor, p) for p in range(n_producers)]
    assert ray.get(ready_ref) is True
    sampled_batches = 0
    while not all(ray.wait([r], timeout=0)[0] for r in producer_refs):  # consumer runs while producers add
        got = ray.get(actor.sample_when_ready.remote(8, 60.0))
        assert got is not None and len({e.uid for e in got}) == 8  # without replacement
        ray.get(actor.on_update.remote())
        sampled_batches += 1
    total = n_producers * n_batches * batch_size
    assert sum(ray.get(producer_refs)) == total
    stored = ray.get(actor.entries.remote())
    uids = [e.uid for e in stored]
    expected = {f"p{p}-b{b}-{i}" for p in range(n_producers) for b in range(n_batches) for i in range(batch_size)}
    assert len(uids) == len(set(uids)) == total and set(uids) == expected  # nothing lost, nothing duplicated
    assert [e.seq for e in stored] == sorted(e.seq for e in stored)
    s = ray.get(actor.stats.remote())
    assert s["inserted"] == total and s["dropped_duplicate"] == n_producers * batch_size
    assert s["sample_calls"] == sampled_batches and s["update_count"] == sampled_batches

    # Bad input through the actor: a ValueError reaches the caller and nothing stored changes.
    bad = _entry("bad")
    bad.reward = float("nan")
    with pytest.raises(ValueError, match="reward"):
        ray.get(actor.add.remote([_entry("fine"), bad]))
    assert ray.get(actor.size.remote()) == total
    assert ray.get(actor.stats.remote())["rejected_batches"] == 1
    packed = PackedEntries.from_entries([_entry("fine"), _entry("negative-logprob")])
    packed.behaviour_logprob[1] = 0.5  # an NLL where a log-prob belongs
    with pytest.raises(ValueError, match=r"entries\[1\] \(uid='negative-logprob'\): behaviour_logprob"):
        ray.get(actor.add.remote(packed))
    assert ray.get(actor.size.remote()) == total
    assert ray.get(actor.stats.remote())["rejected_batches"] == 2
    # packed entries come back as ordinary entries with the same tokens
    assert ray.get(actor.add.remote(PackedEntries.from_entries([_entry("packed-ok")]))) == 1
    back = [e for e in ray.get(actor.entries.remote()) if e.uid == "packed-ok"][0]
    assert back.prompt_ids.tolist() == [1, 2, 3] and back.response_ids.tolist() == [4, 5] and back.n_tokens == 2
    ray.kill(actor)


def test_kill_and_restart_resumes_from_last_snapshot(ray_session, tmp_path):
    path = str(tmp_path / "replay.snap")
    actor = make_replay_actor(
        b_max=50, b_min=2, a_max=3, seed=1, snapshot_path=path, snapshot_every_s=0.2, max_restarts=1
    )
    assert ray.get(actor.add.remote([_entry(f"a{i}") for i in range(3)])) == 3
    assert ray.get(actor.add.remote(put_batch([_entry("a3")]))) == 1  # held by reference: the snapshot fetches it
    assert ray.get(actor.stats.remote())["ref_batches"] == 1
    ray.get(actor.on_update.remote())
    assert ray.get(actor.save.remote()) == path
    on_disk = {e.uid: e for e, *_ in load_snapshot(path)["slots"]}
    assert isinstance(on_disk["a3"], ReplayEntry) and on_disk["a3"].response_ids.tolist() == [4, 5]
    saved = ray.get(actor.stats.remote())
    # The periodic snapshot picks up later changes without an explicit save.
    ray.get(actor.add.remote([_entry("late0"), _entry("late1")]))
    deadline = time.monotonic() + 20
    while ray.get(actor.stats.remote())["snapshots_written"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(actor.stats.remote())["snapshots_written"] >= 2
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # no temporary files left behind

    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 120
    restored = {}
    # ray.kill is asynchronous: a call issued right after it may still reach the old process, and
    # calls that race the restart may fail. Wait for the restarted incarnation to answer.
    while not restored.get("restored_from_snapshot"):
        try:
            restored = ray.get(actor.stats.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, f"the restarted actor never resumed from its snapshot: {restored}"
        time.sleep(0.2)
    assert restored["restored_from_snapshot"] is True
    assert restored["size"] == 6 and restored["update_count"] == 1 == saved["update_count"]
    back = {e.uid: e for e in ray.get(actor.entries.remote())}
    assert set(back) == {"a0", "a1", "a2", "a3", "late0", "late1"}
    assert back["a3"].prompt_ids.tolist() == [1, 2, 3] and back["a3"].P == 0  # the by-reference entry survived
    # the resumed buffer keeps its versions: a0..a3 (P=0) age out at k=4, late0/1 (P=1) at k=5
    for _ in range(3):
        ray.get(actor.on_update.remote())
    assert ray.get(actor.size.remote()) == 2
    ray.kill(actor, no_restart=True)


def test_make_replay_actor_validates_in_caller(ray_session):
    with pytest.raises(ValueError, match="b_min"):
        make_replay_actor(b_max=1, b_min=2, a_max=0, max_restarts=0)
    with pytest.raises(ValueError, match="snapshot_every_s"):
        make_replay_actor(b_max=2, b_min=1, a_max=0, snapshot_every_s=1.0, max_restarts=0)
    with pytest.warns(UserWarning, match="starts empty"):
        actor = make_replay_actor(b_max=2, b_min=1, a_max=0, max_restarts=1)
    ray.kill(actor, no_restart=True)
