"""ReplayBuffer semantics (docs/math.md §A.1): reference trace A.1.7, FIFO/age eviction, sampling, bad input, state."""

import pickle
import warnings

import numpy as np
import pytest

from claas_verl.claas.replay import (
    ReplayBuffer,
    ReplayEntry,
    ScenarioEntry,
    expected_entries_per_split,
    validate_replay_sizes,
)


def _entry(uid, P=None, reward=1.0, scenario_id=0, **kw):
    return ReplayEntry(
        uid=uid,
        scenario_id=scenario_id,
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        behaviour_logprob=-0.7,
        reward=reward,
        P=P,
        **kw,
    )


def _uids(buf):
    return [e.uid for e in buf.entries()]


def test_reference_trace_a17():
    """docs/math.md §A.1.7 with B_max=3, B_min=2, A_max=1, M=2, step by step."""
    buf = ReplayBuffer(b_max=3, b_min=2, a_max=1, seed=0)
    m = 2
    # 1. insert e1 (P=0): not ready
    assert buf.add(_entry("e1", P=0)) == 1
    assert not buf.ready()
    # 2. insert e2 (P=0): ready; update: k=1 and 1-0 = 1 is not > 1 -> nothing evicted
    assert buf.add(_entry("e2", P=0)) == 1
    assert buf.ready()
    assert sorted(e.uid for e in buf.sample(m)) == ["e1", "e2"]  # the only two entries, sampled at k=0
    assert buf.on_update() == 0
    assert buf.update_count == 1 and _uids(buf) == ["e1", "e2"]
    # 3. insert e3 (P=1); update: k=2 -> 2-0 = 2 > 1 evicts e1, e2; 2-1 = 1 keeps e3
    buf.add(_entry("e3", P=1))
    assert buf.ready()
    buf.sample(m)
    assert buf.on_update() == 2
    assert buf.update_count == 2 and _uids(buf) == ["e3"]
    # 4. insert e4, e5, e6 (P=2): 4 entries > B_max=3 -> FIFO pops e3
    assert buf.add([_entry("e4", P=2), _entry("e5", P=2), _entry("e6", P=2)]) == 3
    assert _uids(buf) == ["e4", "e5", "e6"]
    # 5. e7 with reward None is dropped before insertion (never counts toward B_min/B_max)
    assert buf.add(_entry("e7", P=2, reward=None)) == 0
    assert _uids(buf) == ["e4", "e5", "e6"]
    # 6. update: k=3, 3-2 = 1 not > 1 -> all kept
    buf.sample(m)
    assert buf.on_update() == 0
    assert _uids(buf) == ["e4", "e5", "e6"]
    # 7. update: k=4, 4-2 = 2 > 1 -> B = [], not ready
    buf.sample(m)
    assert buf.on_update() == 3
    assert len(buf) == 0 and not buf.ready()

    s = buf.stats()
    assert (s["inserted"], s["dropped_none"], s["evicted_fifo"], s["evicted_age"]) == (6, 1, 1, 5)
    assert (s["sampled"], s["sample_calls"], s["update_count"], s["size"]) == (8, 4, 4, 0)
    # e1/e2 were sampled at k=0 and k=1: exactly A_max+1 = 2 distinct updates, the lifetime bound.
    assert s["max_uses"] <= 2
    assert sum(s["uses_at_eviction"].values()) == 6  # every evicted entry is accounted for
    assert s["uses_at_eviction"].get(2, 0) >= 2


def test_sequence_numbers_and_version_stamping():
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=3)
    buf.add([_entry("a"), _entry("b", P=0)])
    buf.on_update()
    buf.on_update()
    buf.add(_entry("c"))  # no version -> current k = 2 (Algorithm 1 with instantaneous generation)
    stored = buf.entries()
    assert [(e.uid, e.seq, e.P) for e in stored] == [("a", 0, 0), ("b", 1, 0), ("c", 2, 2)]


def test_add_does_not_mutate_caller_entry():
    e = _entry("x")
    ReplayBuffer(b_max=2, b_min=1, a_max=0).add(e)
    assert e.P is None and e.seq is None


def test_future_version_is_clamped_and_counted():
    buf = ReplayBuffer(b_max=5, b_min=1, a_max=1)
    buf.add(_entry("x", P=7))  # weights published before on_update: P=7 > k=0
    assert buf.entries()[0].P == 0 and buf.stats()["future_version_clamped"] == 1
    buf.on_update()
    buf.on_update()  # k=2, 2-0 > 1 -> evicted; unclamped it would have lived until k=9
    assert len(buf) == 0


def test_entry_stale_on_arrival_is_dropped():
    buf = ReplayBuffer(b_max=5, b_min=1, a_max=1)
    buf.on_update()
    buf.on_update()
    buf.on_update()  # k = 3
    # P=1: 3-1 = 2 > 1, the next update would evict it unused -> dropped; P=2: 3-2 = 1 kept
    assert buf.add([_entry("old", P=1), _entry("ok", P=2)]) == 1
    assert _uids(buf) == ["ok"] and buf.stats()["dropped_stale"] == 1


def test_exact_lifetime_a_max_plus_one_updates():
    """An entry with P=p is sampled at k = p … p+A_max and removed when k reaches p+A_max+1 (docs/math.md §A.1.6)."""
    a_max = 3
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=a_max, seed=1)
    buf.add(_entry("x", P=0))
    sampled_at = []
    while len(buf):
        sampled_at.append(buf.update_count)
        buf.sample(1)
        buf.sample(1)  # a second draw at the same k is not a second use
        buf.on_update()
    assert sampled_at == [0, 1, 2, 3]  # A_max+1 = 4 updates
    assert buf.update_count == a_max + 1
    s = buf.stats()
    assert s["uses_at_eviction"] == {4: 1} and s["max_uses"] == 4 and s["sampled"] == 8


def test_fifo_eviction_oldest_first_including_same_batch():
    buf = ReplayBuffer(b_max=3, b_min=1, a_max=10)
    assert buf.add([_entry(f"u{i}") for i in range(5)]) == 5  # all accepted, two popped at once
    assert _uids(buf) == ["u2", "u3", "u4"]
    assert buf.stats()["evicted_fifo"] == 2 and buf.stats()["uses_at_eviction"] == {0: 2}


def test_sample_uniform_without_replacement():
    buf = ReplayBuffer(b_max=8, b_min=4, a_max=100, seed=123)
    buf.add([_entry(f"u{i}") for i in range(8)])
    counts = dict.fromkeys(_uids(buf), 0)
    n_draws = 4000
    for _ in range(n_draws):
        got = [e.uid for e in buf.sample(3)]
        assert len(set(got)) == 3  # without replacement
        for u in got:
            counts[u] += 1
    # each entry is in a draw with probability 3/8: expected 1500, sd = sqrt(4000*3/8*5/8) ≈ 30.6; 5 sd = 153
    for c in counts.values():
        assert abs(c - 1500) < 153


def test_sample_errors():
    buf = ReplayBuffer(b_max=4, b_min=2, a_max=1)
    buf.add(_entry("a"))
    with pytest.raises(ValueError, match="not ready"):
        buf.sample(1)
    buf.add(_entry("b"))
    with pytest.raises(ValueError, match="exceeds"):
        buf.sample(3)
    with pytest.raises(ValueError, match="m must be"):
        buf.sample(0)


def test_sampled_copies_do_not_disturb_storage():
    buf = ReplayBuffer(b_max=4, b_min=1, a_max=1)
    buf.add(_entry("a"))
    got = buf.sample(1)[0]
    got.reward = -5.0
    assert buf.entries()[0].reward == 1.0


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 0, 1), "b_min"),
        ((1, 2, 1), "b_max"),
        ((3, 2, -1), "a_max"),
        ((3.0, 2, 1), "b_max"),
    ],
)
def test_invalid_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        ReplayBuffer(*args)
    with pytest.raises(ValueError, match="entry_unit"):
        ReplayBuffer(3, 2, 1, entry_unit="turn")


def test_validate_replay_sizes():
    validate_replay_sizes(m=8, b_min=8, b_max=1000)
    with pytest.raises(ValueError, match="m "):
        validate_replay_sizes(m=9, b_min=8, b_max=1000)
    with pytest.raises(ValueError, match="b_min = 8 must be <= b_max"):
        validate_replay_sizes(m=1, b_min=8, b_max=4)
    with pytest.raises(ValueError, match="m must be"):
        validate_replay_sizes(m=0, b_min=8, b_max=10)
    # docs/math.md §A.1.8: B_min=100 with 20 scenarios x 4 steps = 80 step entries per split -> warn
    assert expected_entries_per_split(20, 4, "step") == 80
    assert expected_entries_per_split(20, 4, "scenario") == 20
    with pytest.warns(UserWarning, match="b_min = 100"):
        validate_replay_sizes(m=8, b_min=100, b_max=1000, expected_entries_per_split=80)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_replay_sizes(m=8, b_min=80, b_max=1000, expected_entries_per_split=80)


def _snapshot_view(buf):
    state = buf.state_dict()
    view = {"k": state["k"], "next_seq": state["next_seq"], "rng": state["rng_state"], **state["counters"]}
    view["slots"] = [
        (e.uid, e.P, e.seq, e.reward, e.behaviour_logprob, e.response_ids.tolist(), u, lk, d)
        for e, u, lk, d in state["slots"]
    ]
    return view


def test_malformed_batch_is_rejected_whole_and_storage_untouched():
    buf = ReplayBuffer(b_max=5, b_min=1, a_max=2, seed=0)
    buf.add([_entry("a"), _entry("b")])
    before = _snapshot_view(buf)
    bad = _entry("bad")
    bad.behaviour_logprob = float("nan")  # mutated after construction, e.g. arrived through a deserialiser
    with pytest.raises(ValueError, match=r"entries\[1\].*behaviour_logprob"):
        buf.add([_entry("c"), bad, _entry("d")])
    with pytest.raises(ValueError, match=r"entries\[0\] is a str"):
        buf.add(["not an entry"])
    with pytest.raises(ValueError, match="add expects"):
        buf.add(42)
    after = _snapshot_view(buf)
    assert after.pop("rejected_batches") == 3  # the only difference: the rejections are counted
    before.pop("rejected_batches")
    assert after == before
    assert _uids(buf) == ["a", "b"]


def test_duplicate_uids_are_skipped_so_retries_are_idempotent():
    buf = ReplayBuffer(b_max=5, b_min=1, a_max=2)
    batch = [_entry("a"), _entry("b")]
    assert buf.add(batch) == 2
    assert buf.add(batch) == 0  # a retried add
    assert buf.add([_entry("c"), _entry("c")]) == 1
    assert _uids(buf) == ["a", "b", "c"] and buf.stats()["dropped_duplicate"] == 3


def test_entry_unit_is_enforced():
    step_buf = ReplayBuffer(b_max=5, b_min=1, a_max=2)
    scen = ScenarioEntry(steps=[_entry("s0", step_idx=0)])
    with pytest.raises(ValueError, match="entry_unit='step'"):
        step_buf.add(scen)
    with pytest.raises(ValueError, match="entry_unit='scenario'"):
        ReplayBuffer(b_max=5, b_min=1, a_max=2, entry_unit="scenario").add(_entry("x"))


def test_scenario_unit_counts_scenarios_and_uses_min_step_version():
    buf = ReplayBuffer(b_max=2, b_min=1, a_max=1, entry_unit="scenario")
    # scenario A: steps served by versions 0 and 1 -> P = min = 0; reward = min(1, 0) = 0
    a = ScenarioEntry(uid="A", steps=[_entry("a0", P=0, step_idx=0), _entry("a1", P=1, reward=0.0, step_idx=1)])
    # scenario B has a grader error in one step -> dropped whole
    b = ScenarioEntry(uid="B", steps=[_entry("b0", step_idx=0), _entry("b1", reward=None, step_idx=1)])
    assert buf.add([a, b]) == 1
    stored = buf.entries()[0]
    assert (stored.uid, stored.P, stored.reward, len(stored.steps)) == ("A", 0, 0.0, 2)
    assert buf.stats()["dropped_none"] == 1
    buf.on_update()  # k=1: 1-0 = 1 kept
    assert len(buf) == 1
    buf.on_update()  # k=2: 2-0 = 2 > 1 evicted, although one step had version 1
    assert len(buf) == 0
    # B_max counts scenarios (3 scenarios of 2 steps -> 2 kept)
    buf.add(
        [
            ScenarioEntry(uid=f"S{i}", steps=[_entry(f"s{i}0", step_idx=0), _entry(f"s{i}1", step_idx=1)])
            for i in range(3)
        ]
    )
    assert _uids(buf) == ["S1", "S2"]


def test_stats_ages():
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=5)
    buf.add([_entry("a", P=0), _entry("b", P=0)])
    buf.on_update()
    buf.on_update()
    buf.add(_entry("c"))  # P = 2
    s = buf.stats()
    assert s["max_age"] == 2 and s["mean_age"] == pytest.approx(4 / 3)  # ages 2, 2, 0
    assert s["stored_nbytes"] == 3 * (2 + 2) * 4  # 3 entries x 4 int32 tokens


def test_state_round_trip_continues_identically():
    def run(buf, start):
        out = []
        for i in range(start, start + 30):
            buf.add([_entry(f"u{i}a", P=max(0, buf.update_count - i % 3)), _entry(f"u{i}b")])
            if buf.ready():
                out.append([e.uid for e in buf.sample(3)])
            if i % 2:
                buf.on_update()
        return out

    a = ReplayBuffer(b_max=7, b_min=3, a_max=2, seed=5)
    run(a, 0)
    state = pickle.loads(pickle.dumps(a.state_dict(), protocol=5))  # what a snapshot file holds
    b = ReplayBuffer(b_max=7, b_min=3, a_max=2, seed=999)  # different seed: the RNG state must come from state
    b.load_state_dict(state)
    c = ReplayBuffer.from_state_dict(state)
    assert b.stats() == a.stats() == c.stats()
    trace_a = run(a, 100)
    assert run(b, 100) == trace_a and run(c, 100) == trace_a
    assert a.stats() == b.stats()
    assert [(e.uid, e.P, e.seq) for e in a.entries()] == [(e.uid, e.P, e.seq) for e in b.entries()]


def test_load_state_dict_rejects_mismatched_config():
    state = ReplayBuffer(b_max=7, b_min=3, a_max=2).state_dict()
    with pytest.raises(ValueError, match="a_max=2"):
        ReplayBuffer(b_max=7, b_min=3, a_max=4).load_state_dict(state)
    with pytest.raises(ValueError, match="state must be"):
        ReplayBuffer(b_max=7, b_min=3, a_max=2).load_state_dict({"format": 0})


def test_numpy_int_sizes_are_accepted():
    buf = ReplayBuffer(np.int64(3), np.int64(2), np.int64(1))
    assert (buf.b_max, buf.b_min, buf.a_max) == (3, 2, 1)
