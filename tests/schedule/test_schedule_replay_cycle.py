"""``mopd.replay.cycle=reversed`` (benchmarks/plans/mopd_replay.md, E5): a stage's replay steps in the opposite order,
so the first domain is replayed last; ``forward`` (the default) is the MOPD paper's cycle, unchanged."""

from __future__ import annotations

import pytest

from claas_verl.schedule import ScheduleConfig, build_plan
from claas_verl.schedule.budgets import replay_cycle


def _plan(cycle=None, budget="shared", blocks=(4, 4, 12), **replay):
    order = ["a", "b", "c"]
    if cycle is not None:
        replay["cycle"] = cycle
    return build_plan(ScheduleConfig.from_dict({
        "order": order, "domains": {d: {"num_blocks": n} for d, n in zip(order, blocks)}, "budget": budget,
        "replay": replay}))


def _steps(plan, stage):
    return [(s.kind, s.domain, s.block) for s in plan.stage_steps(stage)]


def test_the_reversed_cycle_replays_the_first_domain_last_in_stage_three():
    # stage 3 learns c (12 blocks), m = 3: R = 4 replay steps after new steps 3, 6, 9, 12 (slots ceil(i·12/4)).
    # forward cycles a, b, a, b; each earlier domain gets 2 of its 4 blocks, spread(2, 4) = [0, 3], used ascending.
    # reversed: the same four steps backwards by domain, b, a, b, a, each domain's blocks still ascending.
    new = [("new", "c", i) for i in range(12)]
    forward = _steps(_plan(), 3)
    assert forward == [*new[:3], ("replay", "a", 0), *new[3:6], ("replay", "b", 0), *new[6:9], ("replay", "a", 3),
                       *new[9:], ("replay", "b", 3)]
    reversed_ = _steps(_plan("reversed"), 3)
    assert reversed_ == [*new[:3], ("replay", "b", 0), *new[3:6], ("replay", "a", 0), *new[6:9], ("replay", "b", 3),
                         *new[9:], ("replay", "a", 3)]
    assert all(s.teacher == "student:2" for s in _plan("reversed").stage_steps(3) if s.kind == "replay")


def test_the_default_is_the_forward_cycle_and_stage_two_has_one_order():
    assert _plan() == _plan("forward")  # the key's default changes no plan
    assert _steps(_plan("reversed"), 2) == _steps(_plan(), 2)  # one earlier domain: both orders are [a]
    assert _steps(_plan("reversed"), 1) == _steps(_plan(), 1)


def test_the_fixed_share_reverses_too():
    # fixed share b = 2 from stage 3: R_3 = 2·2 = 4 steps cycling a, b, a, b; reversed b, a, b, a
    fwd = [d for k, d, _ in _steps(_plan(budget="fixed", b=2), 3) if k == "replay"]
    rev = [d for k, d, _ in _steps(_plan("reversed", budget="fixed", b=2), 3) if k == "replay"]
    assert fwd == ["a", "b", "a", "b"] and rev == ["b", "a", "b", "a"]


def test_replay_cycle_keeps_every_domains_count_and_puts_the_first_last():
    # an odd count: forward a, b, a; reversed a, b, a read backwards is a, b, a (still a last)
    assert replay_cycle(["a", "b"], 3, "reversed") == ["a", "b", "a"]
    assert replay_cycle(["a", "b", "c"], 4, "forward") == ["a", "b", "c", "a"]
    assert replay_cycle(["a", "b", "c"], 4, "reversed") == ["a", "c", "b", "a"]
    assert replay_cycle(["a", "b"], 0, "reversed") == []
    with pytest.raises(ValueError, match=r"mopd.replay.cycle must be one of \['forward', 'reversed'\]"):
        replay_cycle(["a"], 1, "random")
