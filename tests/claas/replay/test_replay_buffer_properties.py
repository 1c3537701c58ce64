"""Property tests: random add/sample/update sequences (sequential, then concurrent from three threads) against a
tiny reference model of docs/math.md §A.1."""

import asyncio
import random
import threading
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from claas_verl.claas.replay import (
    AsyncReplayBuffer,
    BatchHandle,
    PackedEntries,
    RefBatch,
    ReplayBuffer,
    ReplayEntry,
)


class ReferenceBuffer:
    """Algorithm 1 written as plainly as possible: a list of dicts, a counter k."""

    def __init__(self, b_max, b_min, a_max):
        self.b_max, self.b_min, self.a_max = b_max, b_min, a_max
        self.k = 0
        self.items = []  # dicts: uid, P, uses, last_k
        self.inserted = self.dropped_none = self.dropped_stale = self.evicted_fifo = self.evicted_age = 0
        self.uses_at_eviction = Counter()

    def add(self, specs):
        accepted = 0
        for uid, reward, version in specs:
            if reward is None:
                self.dropped_none += 1
                continue
            p = self.k if version is None else min(version, self.k)
            if self.k - p > self.a_max:
                self.dropped_stale += 1
                continue
            self.items.append({"uid": uid, "P": p, "uses": 0, "last_k": -1})
            accepted += 1
        self.inserted += accepted
        while len(self.items) > self.b_max:
            self.uses_at_eviction[self.items.pop(0)["uses"]] += 1
            self.evicted_fifo += 1
        return accepted

    def record_sample(self, uids):
        for item in self.items:
            if item["uid"] in uids and item["last_k"] != self.k:
                item["uses"] += 1
                item["last_k"] = self.k

    def on_update(self):
        self.k += 1
        old = [it for it in self.items if self.k - it["P"] > self.a_max]
        self.items = [it for it in self.items if self.k - it["P"] <= self.a_max]
        for it in old:
            self.uses_at_eviction[it["uses"]] += 1
        self.evicted_age += len(old)
        return len(old)


# An op: ("add", [(reward is None?, version offset below k or None), ...]) | ("sample", m) | ("update",)
_add_op = st.tuples(
    st.just("add"),
    st.lists(
        st.tuples(st.booleans().map(lambda none: None if none else 1.0), st.one_of(st.none(), st.integers(-3, 2))),
        min_size=1,
        max_size=6,
    ),
)
_ops = st.lists(st.one_of(_add_op, st.tuples(st.just("sample"), st.integers(1, 4)), st.just(("update",))), max_size=40)


@settings(max_examples=100, deadline=None)
@given(b_min=st.integers(1, 4), extra=st.integers(0, 5), a_max=st.integers(0, 3), ops=_ops, seed=st.integers(0, 9))
def test_buffer_matches_reference_model(b_min, extra, a_max, ops, seed):
    b_max = b_min + extra
    buf, ref = ReplayBuffer(b_max, b_min, a_max, seed=seed), ReferenceBuffer(b_max, b_min, a_max)
    next_uid = 0
    for op in ops:
        if op[0] == "add":
            specs = []
            for reward, offset in op[1]:
                # offset > 0 is a version from the future (clamped to k); negative: served by older weights.
                version = None if offset is None else max(0, ref.k + offset)
                specs.append((f"u{next_uid}", reward, version))
                next_uid += 1
            entries = [
                ReplayEntry(
                    uid=u, scenario_id=0, prompt_ids=[1], response_ids=[2], behaviour_logprob=-1.0, reward=r, P=v
                )
                for u, r, v in specs
            ]
            assert buf.add(entries) == ref.add(specs)
        elif op[0] == "sample":
            m = op[1]
            if len(ref.items) >= b_min and m <= len(ref.items):
                got = [e.uid for e in buf.sample(m)]
                assert len(set(got)) == m and set(got) <= {it["uid"] for it in ref.items}
                ref.record_sample(set(got))
            else:
                try:
                    buf.sample(m)
                except ValueError:
                    pass
                else:
                    raise AssertionError("sample must refuse when not ready or m > len")
        else:
            assert buf.on_update() == ref.on_update()

        assert [(e.uid, e.P) for e in buf.entries()] == [(it["uid"], it["P"]) for it in ref.items]
        assert buf.ready() == (len(ref.items) >= b_min) and buf.update_count == ref.k
        assert len(buf) <= b_max
        s = buf.stats()
        assert (s["inserted"], s["dropped_none"], s["dropped_stale"], s["evicted_fifo"], s["evicted_age"]) == (
            ref.inserted,
            ref.dropped_none,
            ref.dropped_stale,
            ref.evicted_fifo,
            ref.evicted_age,
        )
        assert s["uses_at_eviction"] == dict(ref.uses_at_eviction)
        # the CLaaS lifetime bound: no entry is used in more than A_max+1 distinct updates
        assert s["max_uses"] <= a_max + 1
        assert s["max_age"] <= a_max


# --------------------------------------------------------------------------------------------------------------------
# Concurrent add / sample / update, as the Ray actor runs them: AsyncReplayBuffer called from three event loops on
# three threads (Ray gives each concurrency group of an async actor its own loop and thread). Every buffer call runs
# under the actor's lock, so the order in which a logging buffer records them is a linearization; replaying that order
# on the reference model must explain every result, in particular every sample (no entry sampled after its eviction,
# each with the P it was stored with, k - P <= a_max at the k the sample saw).


class _LoggingBuffer(ReplayBuffer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def add(self, batch):
        cols = batch.columns if isinstance(batch, RefBatch) else batch
        specs = [(u, float(r) if h else None, None if p < 0 else int(p))
                 for u, r, h, p in zip(cols.uid, cols.reward, cols.has_reward, cols.P)]
        n = super().add(batch)
        self.log.append(("add", specs, n))
        return n

    def sample(self, m):
        got = super().sample(m)
        self.log.append(("sample", [(e.uid, e.P) for e in got], self.update_count))
        return got

    def on_update(self):
        n = super().on_update()
        self.log.append(("update", n))
        return n


def _batch(tag, n, versions, rewards, by_ref):
    entries = [
        ReplayEntry(uid=f"{tag}-{i}", scenario_id=0, prompt_ids=[1], response_ids=[2, i], behaviour_logprob=-1.0,
                    reward=rewards[i], P=versions[i])
        for i in range(n)
    ]
    packed = PackedEntries.from_entries(entries)
    if not by_ref:
        return packed
    return RefBatch(handle=BatchHandle(object(), packed.tokens.shape[0]), columns=packed.without_tokens())


@settings(max_examples=12, deadline=None)
@given(b_min=st.integers(1, 4), extra=st.integers(0, 6), a_max=st.integers(0, 2), seed=st.integers(0, 1000))
def test_concurrent_add_sample_update_is_linearizable_against_the_model(b_min, extra, a_max, seed):
    b_max = b_min + extra
    buf = AsyncReplayBuffer(b_max, b_min, a_max, seed=seed)
    logged = _LoggingBuffer(b_max, b_min, a_max, seed=seed)
    buf._replay._parts[buf._replay.names[0]] = logged  # the implicit partition, logging every call
    rng = random.Random(seed)
    plans = [[(rng.randint(1, 3), rng.random() < 0.5) for _ in range(12)] for _ in range(2)]
    errors = []

    def run(coro_fn):
        def target():
            try:
                asyncio.run(coro_fn())
            except BaseException as exc:  # surfaced below
                errors.append(exc)
        return threading.Thread(target=target)

    def producer(p):
        async def go():
            r = random.Random(seed * 31 + p)
            for b, (n, by_ref) in enumerate(plans[p]):
                versions = [r.choice([None, 0, 1, 2, 3]) for _ in range(n)]
                rewards = [None if r.random() < 0.15 else 1.0 for _ in range(n)]
                await buf.add(_batch(f"p{p}b{b}", n, versions, rewards, by_ref))
                await asyncio.sleep(0)
        return go

    async def sampler():
        for i in range(15):
            m = 1 + i % b_min
            got = await buf.sample_when_ready(m, 0.02)
            if got is not None:
                assert len({e.uid for e in got}) == m
            await asyncio.sleep(0)

    async def updater():
        for _ in range(6):
            await buf.on_update()
            await asyncio.sleep(0.001)

    threads = [run(producer(0)), run(producer(1)), run(sampler), run(updater)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors

    ref = ReferenceBuffer(b_max, b_min, a_max)
    for op in logged.log:
        if op[0] == "add":
            assert ref.add(op[1]) == op[2]
        elif op[0] == "sample":
            stored = {it["uid"]: it["P"] for it in ref.items}
            assert op[2] == ref.k and len(stored) >= b_min
            for uid, p in op[1]:
                assert uid in stored and stored[uid] == p, f"{uid} sampled but not stored (or with another P)"
                assert ref.k - p <= a_max
            ref.record_sample({uid for uid, _ in op[1]})
        else:
            assert ref.on_update() == op[1]
    assert [(e.uid, e.P) for e in logged.entries()] == [(it["uid"], it["P"]) for it in ref.items]
    s = logged.stats()
    assert (s["inserted"], s["evicted_fifo"], s["evicted_age"], s["update_count"]) == (
        ref.inserted, ref.evicted_fifo, ref.evicted_age, 6)
    assert s["uses_at_eviction"] == dict(ref.uses_at_eviction) and s["max_uses"] <= a_max + 1
