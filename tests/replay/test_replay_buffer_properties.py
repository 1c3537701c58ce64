"""Property tests: random add/sample/update sequences against a tiny reference model of SPEC A.1."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from claas_verl.replay import ReplayBuffer, ReplayEntry


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
