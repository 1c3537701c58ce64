"""MOPD paper appendix Table 7 (replay and recovery blocks) and the step totals, derived from the B.8 rules.

The expected cells below are typed from the paper's table; the library computes them from
``spread`` + the budget rules, never from a lookup.
"""

import pytest

from claas_verl.schedule import ScheduleConfig, build_plan, spread
from claas_verl.schedule.budgets import replay_slots

ORDER5 = ["logic", "math", "code", "safety", "if"]
BLOCKS5 = [20, 21, 21, 21, 21]


def make(budget="seq", K=5, setting="S1", **mopd):
    mopd.setdefault("replay", {})
    return build_plan(ScheduleConfig.from_dict({
        "order": ORDER5[:K],
        "domains": {d: {"num_blocks": n} for d, n in zip(ORDER5[:K], BLOCKS5[:K])},
        "budget": budget,
        "setting": setting,
        **mopd,
    }))


# Table 7, "Shared budget": stage -> {domain: blocks}
SHARED = {
    2: {"logic": [0, 3, 6, 10, 13, 16, 19]},
    3: {"logic": [0, 6, 13, 19], "math": [0, 10, 20]},
    4: {"logic": [0, 10, 19], "math": [0, 20], "code": [0, 20]},
    5: {"logic": [0, 19], "math": [0, 20], "code": [0, 20], "safety": [0]},
}
# Table 7, "Fixed share, b = 7" (stage 2 is the shared stage 2)
FIXED7 = {
    2: SHARED[2],
    3: {"logic": [0, 3, 6, 9, 11, 14, 17], "math": [0, 3, 6, 9, 12, 15, 18]},
    4: {"logic": [1, 4, 7, 10, 12, 15, 18], "math": [1, 4, 7, 10, 13, 16, 19], "code": [0, 3, 6, 9, 12, 15, 18]},
    5: {"logic": [2, 5, 8, 10, 13, 16, 19], "math": [2, 5, 8, 11, 14, 17, 20], "code": [2, 5, 8, 11, 14, 17, 20],
        "safety": [0, 3, 7, 10, 13, 17, 20]},
}
# Table 7, "Fixed share, b = 3"
FIXED3 = {
    2: SHARED[2],
    3: {"logic": [0, 7, 14], "math": [0, 8, 15]},
    4: {"logic": [2, 10, 17], "math": [2, 10, 18], "code": [0, 8, 16]},
    5: {"logic": [5, 12, 19], "math": [5, 12, 20], "code": [4, 12, 20], "safety": [0, 10, 20]},
}
REC_LOGIC = [0, 3, 6, 10, 13, 16, 19]
REC_OTHER = [0, 3, 7, 10, 13, 17, 20]
REC70_LOGIC = [0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19]
REC70_OTHER = [0, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18, 20]


def replay_table(plan):
    out = {}
    for s in plan.steps:
        if s.kind == "replay":
            out.setdefault(s.stage, {}).setdefault(s.domain, []).append(s.block)
    return out


@pytest.mark.parametrize("budget,replay,expected", [
    ("shared", {"m": 3}, SHARED),
    ("fixed", {"m": 3, "b": 7, "fixed_from_stage": 3}, FIXED7),
    ("fixed", {"m": 3, "b": 3, "fixed_from_stage": 3}, FIXED3),
])
def test_table7_replay_cells(budget, replay, expected):
    assert replay_table(make(budget, replay=replay)) == expected


def test_half_even_rounding_is_what_table7_needs():
    # math, b=3: pool = round(linspace(0, 20, 9)) = round(0, 2.5, 5, 7.5, 10, 12.5, 15, 17.5, 20)
    # half-even: 2.5->2, 7.5->8, 12.5->12, 17.5->18 (half-up would give 3, 8, 13, 18 and break stage 4/5)
    assert spread(9, 21) == [0, 2, 5, 8, 10, 12, 15, 18, 20]
    assert spread(0, 21) == [] and spread(1, 21) == [0]


@pytest.mark.parametrize("K,c,logic,other,steps", [
    (3, 7, REC_LOGIC, REC_OTHER, 21),
    (5, 7, REC_LOGIC, REC_OTHER, 35),
    (5, 14, REC70_LOGIC, REC70_OTHER, 70),
])
def test_table7_recovery_cells(K, c, logic, other, steps):
    plan = make("seq", K=K, setting="S2", recovery={"enabled": True, "blocks_per_domain": c})
    rec = [s for s in plan.steps if s.kind == "recovery"]
    assert len(rec) == steps
    assert {s.stage for s in rec} == {K + 1}
    assert plan.blocks(K + 1, "recovery", "logic") == logic
    for d in ORDER5[1:K]:
        assert plan.blocks(K + 1, "recovery", d) == other
    # step i teaches domain i mod K: the domains are taken in turn
    assert [s.domain for s in rec[:2 * K]] == ORDER5[:K] * 2
    # teachers: stage-final students, the shared stage-1 model for logic, M_K for the last domain
    assert {s.domain: s.teacher for s in rec} == {d: f"student:{k}" for k, d in enumerate(ORDER5[:K], 1)}


@pytest.mark.parametrize("kwargs,total", [
    (dict(budget="seq"), 104),
    (dict(budget="shared"), 132),
    (dict(budget="fixed", replay={"b": 3}), 138),
    (dict(budget="fixed", replay={"b": 7}), 174),
    (dict(budget="seq", setting="S2", recovery={"enabled": True}), 139),
    (dict(budget="seq", setting="S2", recovery={"enabled": True, "blocks_per_domain": 14}), 174),
    (dict(budget="shared", setting="S2", recovery={"enabled": True}), 167),
    (dict(budget="fixed", replay={"b": 7}, setting="S2", recovery={"enabled": True}), 209),
    (dict(budget="seq", setting="S2", joint={"enabled": True}), 104),
    (dict(budget="seq", setting="S2", joint={"enabled": True, "passes": 2}), 208),
    (dict(budget="seq", K=3), 62),
    (dict(budget="shared", K=3), 76),
    (dict(budget="seq", K=3, setting="S2", recovery={"enabled": True}), 83),
])
def test_step_totals(kwargs, total):
    assert len(make(**kwargs)) == total


def test_replay_counts_and_distinct_blocks_of_003():
    # MOPD paper §5.1: shared budget gives logic 16, math 7, code 4, safety 1 replay steps and 13 distinct blocks
    plan = make("shared")
    rep = [s for s in plan.steps if s.kind == "replay"]
    assert {d: sum(s.domain == d for s in rep) for d in ORDER5[:4]} == {"logic": 16, "math": 7, "code": 4, "safety": 1}
    assert len({(s.domain, s.block) for s in rep}) == 13
    # b=3: 34 replay steps, 31 distinct blocks; b=7: 70 replay steps (= 7 + b(K(K-1)/2 - 1))
    rep3 = [s for s in make("fixed", replay={"b": 3}).steps if s.kind == "replay"]
    assert len(rep3) == 34 and len({(s.domain, s.block) for s in rep3}) == 31
    assert sum(s.kind == "replay" for s in make("fixed", replay={"b": 7}).steps) == 7 + 7 * (5 * 4 // 2 - 1)


def test_stage_lengths_of_fixed_share():
    # MOPD paper §5.1: b=7 -> stages 3, 4, 5 have 35, 42, 49 steps; b=3 -> 27, 30, 33
    for b, lengths in [(7, [35, 42, 49]), (3, [27, 30, 33])]:
        plan = make("fixed", replay={"b": b})
        assert [len(plan.stage_steps(k)) for k in (3, 4, 5)] == lengths


def test_positions_shared_one_replay_after_every_third_new_step():
    plan = make("shared")
    stage2 = plan.stage_steps(2)
    after = []
    new_seen = 0
    for s in stage2:
        if s.kind == "new":
            new_seen += 1
        else:
            after.append(new_seen)
    assert after == [3, 6, 9, 12, 15, 18, 21]


def test_positions_examples_of_spec():
    # n=21, R=14 -> slots 2,3,5,6,...,20,21 ; R=28 -> two replays after every third new step
    assert replay_slots(21, 14) == [2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18, 20, 21]
    slots28 = replay_slots(21, 28)
    assert {t: slots28.count(t) for t in set(slots28)} == {
        **{t: 1 for t in range(1, 22) if t % 3 != 0}, **{t: 2 for t in range(3, 22, 3)}}


def test_joint_order_flag_and_rounds():
    plan = make("seq", setting="S2", joint={"enabled": True, "order": ["math", "code", "logic", "safety", "if"]})
    first = [(s.domain, s.block) for s in plan.steps[:6]]
    assert first == [("math", 0), ("code", 0), ("logic", 0), ("safety", 0), ("if", 0), ("math", 1)]
    # logic has 20 blocks: the last round (r=20) skips it
    assert [s.domain for s in plan.steps[-4:]] == ["math", "code", "safety", "if"]
    assert all(s.teacher == f"expert:{s.domain}" and s.stage == 1 for s in plan.steps)
