"""The tenant scheduler: a hand-derived sequence, the wait bound under adversarial arrivals, and its checkpoint."""

from __future__ import annotations

import json
import random

import pytest

from claas_verl.claas.tenants.scheduler import TenantScheduler


def test_a_hand_derived_sequence():
    s = TenantScheduler(["a", "b", "c"])
    # n=0: only a is ready                                              -> a   (a marked 0, waited 0)
    # n=1: a, b marked 1; staleness a = 1-0 = 1, b = 1-(-1) = 2          -> b   (b waited 0)
    # n=2: a (mark 1) before b, c (marked 2)                             -> a   (a waited 2-1 = 1)
    # n=3: b, c marked 2; staleness b = 3-1 = 2, c = 3-(-1) = 4; a mark 3 -> c   (c waited 3-2 = 1)
    # n=4: b (mark 2) before a (mark 3)                                  -> b   (b waited 4-2 = 2)
    # n=5: a (mark 3) before c (mark 4)                                  -> a   (a waited 5-3 = 2 = N-1)
    readies = [{"a"}, {"a", "b"}, {"a", "b", "c"}, {"a", "b", "c"}, {"a", "b", "c"}, {"a", "b", "c"}]
    assert [s.pick(r) for r in readies] == ["a", "b", "a", "c", "b", "a"]
    assert s.worst_wait == {"a": 2, "b": 2, "c": 1} and s.bound == 2
    assert s.granted == {"a": 3, "b": 2, "c": 1} and s.updates == 6
    assert s.pick(set()) is None and s.updates == 6  # nothing ready: nothing granted, every mark dropped
    assert s.stats()["tenants"]["c"] == {"granted": 1, "staleness": 3, "waiting": None, "worst_wait": 1}


def test_the_bound_is_tight_when_everyone_becomes_ready_at_once():
    n = 6
    names = [f"t{i}" for i in range(n)]
    s = TenantScheduler(names)
    order = [s.pick(names) for _ in range(n)]  # every tenant stays ready (its partition does until its update)
    assert order == names  # equal marks, equal staleness (never updated): configuration order
    assert s.worst_wait["t5"] == n - 1 == s.bound
    # then round robin, one update per tenant per n updates
    assert [s.pick(names) for _ in range(2 * n)] == names * 2


def test_a_hot_tenant_cannot_starve_a_late_one():
    s = TenantScheduler(["hot", "x", "late"])
    for _ in range(5):
        assert s.pick({"hot"}) == "hot"  # only hot has entries
    assert s.pick({"hot", "late"}) == "late"  # equal marks (5); late never updated: staler than hot (5 - 4 = 1)
    # hot and x keep arriving; late is ready again from n = 6 on
    picks = [s.pick({"hot", "x", "late"}) for _ in range(6)]
    assert picks == ["hot", "x", "late", "hot", "x", "late"]
    assert max(s.worst_wait.values()) <= s.bound


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_holds_under_random_adversarial_arrivals(seed):
    """The adversary decides who becomes ready at every step; a ready tenant stays ready until it is picked (what
    a replay partition guarantees). Every tenant is picked within N - 1 updates of its mark."""
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    names = [f"t{i}" for i in range(n)]
    s = TenantScheduler(names)
    ready: dict[str, int] = {}  # tenant -> update count at which it became ready
    for _ in range(300):
        for t in names:
            if t not in ready and rng.random() < rng.choice([0.05, 0.5, 0.95]):
                ready[t] = s.updates
        picked = s.pick(set(ready))
        if picked is None:
            continue
        waited = s.updates - 1 - ready.pop(picked)
        assert waited <= n - 1, (picked, waited)
        assert all(s.updates - since <= n - 1 for since in ready.values())  # nobody left behind past the bound
    assert max(s.worst_wait.values()) <= s.bound


def test_a_tenant_that_stops_being_ready_restarts_its_wait():
    s = TenantScheduler(["a", "b"])
    assert s.pick({"a", "b"}) == "a"
    assert s.waiting("b") == 1
    assert s.pick({"a"}) == "a"  # b reported not ready: its mark is dropped
    assert s.waiting("b") is None
    assert s.pick({"a", "b"}) == "b"  # both marked 2; b staler (never updated)


def test_state_round_trip_continues_exactly():
    rng = random.Random(3)
    names = ["a", "b", "c", "d"]
    first = TenantScheduler(names)
    seq = [{t for t in names if rng.random() < 0.6} for _ in range(80)]
    for r in seq[:37]:
        first.pick(r)
    state = json.loads(json.dumps(first.state_dict()))  # plain data: it travels in a JSON checkpoint
    resumed = TenantScheduler(names)
    resumed.load_state_dict(state)
    assert [first.pick(r) for r in seq[37:]] == [resumed.pick(r) for r in seq[37:]]
    assert first.state_dict() == resumed.state_dict()


def test_bad_inputs_are_refused_by_name():
    s = TenantScheduler(["a", "b"])
    with pytest.raises(ValueError, match=r"ready names tenants \['z'\]"):
        s.pick({"a", "z"})
    with pytest.raises(ValueError, match="saved for tenants"):
        TenantScheduler(["b", "a"]).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="format 1"):
        s.load_state_dict({})
    bad = {**s.state_dict(), "mark": {"a": 5}}
    with pytest.raises(ValueError, match="after update 0"):
        s.load_state_dict(bad)
    with pytest.raises(ValueError, match="named twice"):
        TenantScheduler(["a", "a"])
