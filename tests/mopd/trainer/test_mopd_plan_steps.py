"""Plan position, teachers and model paths (claas_verl.mopd.trainer.plan_steps): pure python, hand-checked cases."""

from __future__ import annotations

import pytest

from claas_verl.mopd.trainer.plan_steps import (
    ModelPaths,
    check_held,
    learned_domains,
    plan_fingerprint,
    stage_bounds,
    stage_teachers,
    step_index,
    taught_domains,
)


def test_step_index_is_global_step_minus_one_and_bounded():
    assert step_index(1, 12) == 0 and step_index(12, 12) == 11
    with pytest.raises(ValueError, match="total_training_steps"):
        step_index(13, 12)
    with pytest.raises(ValueError):
        step_index(0, 12)


def test_stage_bounds_and_teachers_of_shared_budget(small_plan):
    # tiny shared budget (m=3): stage 1 = 4 logic steps; stage 2 = 3 math + 1 replay (logic) after the 3rd;
    # stage 3 = 3 code + 1 replay: 12 steps in all
    plan, steps = small_plan("shared")
    assert stage_bounds(steps) == {1: (0, 3), 2: (4, 7), 3: (8, 11)}
    assert stage_teachers(steps, 1) == ["expert:logic"]
    assert stage_teachers(steps, 2) == ["expert:math", "student:1"]
    assert stage_teachers(steps, 3) == ["expert:code", "student:2"]
    for st in (1, 2, 3):  # S1 allows exactly what the stage uses
        check_held(stage_teachers(steps, st), plan.held_by_stage[st], st, "S1")
    with pytest.raises(ValueError, match="holds only"):
        check_held(["expert:logic"], plan.held_by_stage[3], 3, "S1")
    assert learned_domains(steps, 3) == ["logic"] and learned_domains(steps, 11) == ["logic", "math", "code"]


def test_model_paths():
    paths = ModelPaths(student0="/m/pi0", experts={"logic": "/e/logic", "math": "???"}, run_dir="/run")
    assert paths.path("student:0") == "/m/pi0"
    assert paths.path("student:2") == "/run/snapshots/student_2"
    assert paths.path("expert:logic") == "/e/logic"
    with pytest.raises(ValueError, match="mopd.domains.math.expert"):
        paths.path("expert:math")
    with pytest.raises(ValueError, match="unknown model name"):
        paths.path("teacher:1")


def test_plan_fingerprint_changes_with_thesmall_plan(small_plan):
    _, seq = small_plan("seq")
    _, shared = small_plan("shared")
    assert plan_fingerprint(seq) == plan_fingerprint([dict(s, extra=1) for s in seq])  # only plan keys count
    assert plan_fingerprint(seq) != plan_fingerprint(shared)


def test_taught_domains_are_the_new_or_joint_domains_of_a_stage():
    steps = [
        {"stage": 1, "kind": "new", "domain": "logic"},
        {"stage": 2, "kind": "new", "domain": "math"},
        {"stage": 2, "kind": "replay", "domain": "logic"},
        {"stage": 3, "kind": "recovery", "domain": "logic"},
        {"stage": 4, "kind": "joint", "domain": "code"},
        {"stage": 4, "kind": "joint", "domain": "math"},
        {"stage": 4, "kind": "joint", "domain": "code"},
    ]
    assert taught_domains(steps, 1) == ["logic"]
    assert taught_domains(steps, 2) == ["math"]
    assert taught_domains(steps, 3) == []
    assert taught_domains(steps, 4) == ["code", "math"]
