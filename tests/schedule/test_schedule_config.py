"""ScheduleConfig validation: every invalid value names its key; settings refuse what they do not keep."""

import pytest

from claas_verl.schedule import ScheduleConfig, build_plan
from claas_verl.schedule.build import check_plan_setting
from claas_verl.schedule.plan import Plan, Step


def base(**over):
    cfg = {"order": ["logic", "math", "code"],
           "domains": {"logic": {"num_blocks": 4}, "math": {"num_blocks": 3}, "code": {"num_blocks": 3}},
           "budget": "shared", "replay": {"m": 3, "b": 2, "fixed_from_stage": 3}}
    for k, v in over.items():
        cfg[k] = v
    return cfg


@pytest.mark.parametrize("over,key", [
    (dict(order=["logic", "chem"]), "mopd.order"),
    (dict(order=[]), "mopd.order"),
    (dict(order=["logic", "logic"]), "mopd.order"),
    (dict(order="???"), "mopd.order"),
    (dict(budget="sometimes"), "mopd.budget"),
    (dict(replay={"m": 0}), "mopd.replay.m"),
    (dict(replay={"m": 1.5}), "mopd.replay.m"),
    (dict(replay={"b": -1}), "mopd.replay.b"),
    (dict(replay={"fixed_from_stage": 1}), "mopd.replay.fixed_from_stage"),
    (dict(setting="S2", replay={"teachers": "oracles"}), "mopd.replay.teachers"),
    (dict(block_size=0), "mopd.block_size"),
    (dict(domains={"logic": {"num_blocks": 0}, "math": {"num_blocks": 3}, "code": {"num_blocks": 3}}),
     "mopd.domains.logic.num_blocks"),
    (dict(domains={"logic": {"num_blocks": 4}, "math": {"num_blocks": 3}, "code": {"prompts": "???"}}),
     "mopd.domains.code.num_blocks"),
    (dict(setting="S2", recovery={"enabled": True, "blocks_per_domain": 4}), "mopd.recovery.blocks_per_domain"),
    (dict(setting="S2", recovery={"enabled": True, "blocks_per_domain": 0}), "mopd.recovery.blocks_per_domain"),
    (dict(setting="S2", recovery={"enabled": "yes"}), "mopd.recovery.enabled"),
    (dict(setting="S2", recovery={"enabled": True, "teachers": "oracles"}), "mopd.recovery.teachers"),
    (dict(setting="S2", budget="seq", joint={"enabled": True, "passes": 0}), "mopd.joint.passes"),
    (dict(setting="S2", budget="seq", joint={"enabled": True, "order": ["math", "code"]}), "mopd.joint.order"),
    (dict(setting="S3", recovery={"enabled": True, "blocks_per_domain": 2}, segments={"size": 0}),
     "mopd.segments.size"),
    (dict(setting="S4"), "mopd.setting"),
])
def test_invalid_values_name_their_key(over, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ScheduleConfig.from_dict(base(**over))


def test_recovery_under_s1_is_refused_with_why_and_fix():
    with pytest.raises(ValueError) as e:
        ScheduleConfig.from_dict(base(recovery={"enabled": True, "blocks_per_domain": 2}))
    msg = str(e.value)
    assert "mopd.recovery.enabled" in msg and "S1" in msg  # what
    assert "M_1..M_K" in msg  # why: it needs every snapshot
    assert "mopd.setting=S2" in msg and "mopd.recovery.enabled=false" in msg  # what to change


def test_replay_toward_the_experts_under_s1_is_refused_with_why_and_fix():
    with pytest.raises(ValueError) as e:
        ScheduleConfig.from_dict(base(replay={"m": 3, "teachers": "experts"}))
    msg = str(e.value)
    assert "mopd.replay.teachers=experts" in msg and "S1" in msg  # what
    assert "M_{k-1}" in msg  # why: S1 keeps only E_k and M_{k-1}
    assert "mopd.setting=S2" in msg and "mopd.replay.teachers=previous" in msg  # what to change
    ScheduleConfig.from_dict(base(budget="seq", replay={"teachers": "experts"}))  # no replay step: nothing to keep


@pytest.mark.parametrize("budget", ["shared", "fixed"])
def test_replay_toward_the_experts_changes_only_the_replay_teachers(budget):
    # the same steps, blocks and order as replay toward M_{k-1}; each replay step is taught by its own domain's
    # expert, and the plan keeps the earlier experts it replays (setting S2)
    previous = build_plan(ScheduleConfig.from_dict(base(setting="S2", budget=budget)))
    experts = build_plan(ScheduleConfig.from_dict(base(setting="S2", budget=budget,
                                                       replay={"m": 3, "b": 2, "teachers": "experts"})))
    assert len(experts) == len(previous) and any(s.kind == "replay" for s in previous.steps)
    for a, b in zip(previous.steps, experts.steps):
        assert (a.stage, a.kind, a.domain, a.block) == (b.stage, b.kind, b.domain, b.block)
        if a.kind == "replay":
            assert a.teacher == f"student:{a.stage - 1}" and b.teacher == f"expert:{a.domain}"
        else:
            assert b.teacher == a.teacher
    assert "expert:logic" in experts.held_by_stage[3] and "expert:logic" not in previous.held_by_stage[3]


@pytest.mark.parametrize("over,fix", [
    (dict(budget="seq", joint={"enabled": True}), "mopd.setting=S2"),  # joint under S1
    (dict(setting="S2", joint={"enabled": True}), "mopd.budget=seq"),  # joint takes no replay budget
    (dict(setting="S2", recovery={"enabled": True, "blocks_per_domain": 2}, segments={"size": 2}), "mopd.setting=S3"),
    (dict(segments={"size": 2}), "mopd.setting=S3"),  # under S1
    (dict(setting="S3", recovery={"enabled": True, "blocks_per_domain": 2}), "mopd.segments.size"),
    (dict(setting="S3", segments={"size": 2}), "mopd.recovery.enabled=true"),
])
def test_setting_mismatches_say_what_to_change(over, fix):
    with pytest.raises(ValueError, match=fix.replace(".", r"\.")):
        ScheduleConfig.from_dict(base(**over))


def test_plan_level_setting_check_catches_a_hand_made_s1_violation():
    # a replay step taught by M_1 in stage 3 would need M_1 kept past stage 2: not S1
    steps = (Step(1, "new", "a", 0, "expert:a"), Step(2, "new", "b", 0, "expert:b"),
             Step(3, "new", "c", 0, "expert:c"), Step(3, "replay", "a", 0, "student:1"))
    plan = Plan(steps=steps, order=("a", "b", "c"), num_blocks={"a": 1, "b": 1, "c": 1}, setting="S1")
    assert plan.held_by_stage[2] == ("expert:b", "student:1")
    with pytest.raises(ValueError, match="stage 3 would have to keep"):
        check_plan_setting(plan)


def test_plan_rejects_out_of_range_block():
    with pytest.raises(ValueError, match="block 3 of 3"):
        Plan(steps=(Step(1, "new", "a", 3, "expert:a"),), order=("a",), num_blocks={"a": 3})


def test_extra_domains_outside_order_are_allowed_for_prefix_runs():
    cfg = base(order=["logic", "math"])
    cfg["domains"]["safety"] = {"prompts": "???"}  # never read: not in the order
    assert len(build_plan(ScheduleConfig.from_dict(cfg))) == 4 + 3 + 1


def test_block_count_floors_the_rows_the_caller_counts():
    # the planner opens no file: the caller's count_rows(prompts, key) gives the rows, 10 rows / block_size 4 -> 2
    # full blocks (the partial third block of 2 prompts is dropped)
    rows = {"logic.parquet": 12, "math.jsonl": 10}
    cfg = ScheduleConfig.from_dict({
        "order": ["logic", "math"], "block_size": 4,
        "domains": {"logic": {"prompts": "logic.parquet"}, "math": {"prompts": "math.jsonl", "num_blocks": None}},
    }, count_rows=lambda prompts, key: rows[prompts])
    assert cfg.num_blocks == {"logic": 3, "math": 2}
    with pytest.raises(ValueError, match=r"mopd\.domains\.math\.prompts: 'math.jsonl' holds fewer than"):
        ScheduleConfig.from_dict({"order": ["math"], "block_size": 11, "domains": {"math": {"prompts": "math.jsonl"}}},
                                 count_rows=lambda prompts, key: rows[prompts])
    with pytest.raises(ValueError, match=r"mopd\.domains\.math\.num_blocks: not set, and no row counter"):
        ScheduleConfig.from_dict({"order": ["math"], "domains": {"math": {"prompts": "math.jsonl"}}})
