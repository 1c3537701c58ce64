"""Run records of the MOPD trainer (claas_verl.mopd.trainer.records): pure python, hand-checked cases."""

from __future__ import annotations

import json

import pytest

from claas_verl.mopd.trainer import records as S
from claas_verl.schedule import ScheduleConfig, build_plan


def _plan(budget="shared", recovery=False, setting="S1"):
    cfg = ScheduleConfig.from_dict({
        "order": ["logic", "math", "code"],
        "block_size": 4,
        "budget": budget,
        "setting": setting,
        "replay": {"m": 3},
        "recovery": {"enabled": recovery, "blocks_per_domain": 2},
        "domains": {d: {"num_blocks": n, "prompts": None, "expert": f"/e/{d}"}
                    for d, n in (("logic", 4), ("math", 3), ("code", 3))},
    })
    plan = build_plan(cfg)
    return plan, [s.to_dict() for s in plan.steps]


def test_step_index_is_global_step_minus_one_and_bounded():
    assert S.step_index(1, 12) == 0 and S.step_index(12, 12) == 11
    with pytest.raises(ValueError, match="total_training_steps"):
        S.step_index(13, 12)
    with pytest.raises(ValueError):
        S.step_index(0, 12)


def test_stage_bounds_and_teachers_of_shared_budget():
    # tiny shared budget (m=3): stage 1 = 4 logic steps; stage 2 = 3 math + 1 replay (logic) after the 3rd;
    # stage 3 = 3 code + 1 replay: 12 steps in all
    plan, steps = _plan("shared")
    assert S.stage_bounds(steps) == {1: (0, 3), 2: (4, 7), 3: (8, 11)}
    assert S.stage_teachers(steps, 1) == ["expert:logic"]
    assert S.stage_teachers(steps, 2) == ["expert:math", "student:1"]
    assert S.stage_teachers(steps, 3) == ["expert:code", "student:2"]
    for st in (1, 2, 3):  # S1 allows exactly what the stage uses
        S.check_held(S.stage_teachers(steps, st), plan.held_by_stage[st], st, "S1")
    with pytest.raises(ValueError, match="holds only"):
        S.check_held(["expert:logic"], plan.held_by_stage[3], 3, "S1")
    assert S.learned_domains(steps, 3) == ["logic"] and S.learned_domains(steps, 11) == ["logic", "math", "code"]


def test_model_paths():
    paths = S.ModelPaths(student0="/m/pi0", experts={"logic": "/e/logic", "math": "???"}, run_dir="/run")
    assert paths.path("student:0") == "/m/pi0"
    assert paths.path("student:2") == "/run/snapshots/student_2"
    assert paths.path("expert:logic") == "/e/logic"
    with pytest.raises(ValueError, match="mopd.domains.math.expert"):
        paths.path("expert:math")
    with pytest.raises(ValueError, match="unknown model name"):
        paths.path("teacher:1")


def test_plan_fingerprint_changes_with_the_plan():
    _, seq = _plan("seq")
    _, shared = _plan("shared")
    assert S.plan_fingerprint(seq) == S.plan_fingerprint([dict(s, extra=1) for s in seq])  # only plan keys count
    assert S.plan_fingerprint(seq) != S.plan_fingerprint(shared)


def test_steps_jsonl_append_and_truncate_on_resume(tmp_path):
    _, steps = _plan("seq")
    for gs in (1, 2, 3):
        S.append_step(str(tmp_path), gs, steps[gs - 1], {"mopd/kl_topk": 0.5, "bad": float("nan"), "name": "x"})
    recs = S.read_steps(str(tmp_path))
    assert [r["global_step"] for r in recs] == [1, 2, 3]
    assert recs[0]["metrics"] == {"bad": None, "mopd/kl_topk": 0.5, "name": "x"}  # NaN is not valid JSON
    assert {k: recs[1][k] for k in S.PLAN_KEYS} == steps[1]
    assert S.truncate_steps(str(tmp_path), 1) == 2
    assert [r["global_step"] for r in S.read_steps(str(tmp_path))] == [1]
    discarded = (tmp_path / S.DISCARDED_FILE).read_text().splitlines()
    assert [json.loads(x)["global_step"] for x in discarded] == [2, 3]


def test_state_round_trip_is_atomic(tmp_path):
    assert S.read_state(str(tmp_path / "global_step_3")) is None
    S.write_state(str(tmp_path / "global_step_3"), {"stage": 2, "snapshots": [1]})
    assert S.read_state(str(tmp_path / "global_step_3")) == {"stage": 2, "snapshots": [1]}
    assert not (tmp_path / "global_step_3" / (S.STATE_FILE + ".tmp")).exists()


def test_existing_snapshots(tmp_path):
    paths = S.ModelPaths(student0="/m", experts={}, run_dir=str(tmp_path))
    (tmp_path / "snapshots" / "student_2").mkdir(parents=True)
    (tmp_path / "snapshots" / "student_2" / "config.json").write_text("{}")
    (tmp_path / "snapshots" / "student_1").mkdir(parents=True)  # no config.json: an interrupted copy
    assert S.existing_snapshots(paths, 3) == [2]


def test_forgetting_table_layout(tmp_path):
    rows = [
        {"stage": 1, "at": "start", "domain": "logic", "kl": 0.75, "kl_binned": 1.5, "score": None},
        {"stage": 1, "at": "end", "domain": "logic", "kl": 0.25, "kl_binned": 0.5, "score": 0.5},
        {"stage": 2, "at": "end", "domain": "logic", "kl": 0.375, "score": None},
        {"stage": 2, "at": "end", "domain": "math", "kl": 0.125, "score": 1.0},
    ]
    S.append_forgetting(str(tmp_path), rows)
    table = S.forgetting_table(S.read_forgetting(str(tmp_path)), title="seq")
    lines = table.splitlines()
    assert lines[0] == "### seq"
    assert lines[1] == "| after stage | KL to E[logic] (score) | KL to E[math] (score) |"
    assert lines[3] == "| 1 | 0.2500 (0.50) |  |"
    assert lines[4] == "| 2 | 0.3750 | 0.1250 (1.00) |"
    assert lines[6] == ("| stage | taught domain | KL to its expert at stage start | at stage end | change "
                        "| (k+1)-bin KL start → end |")
    assert lines[8] == "| 1 | logic | 0.7500 | 0.2500 (0.50) | -0.5000 | 1.5000 → 0.5000 |"
    assert len(lines) == 9
    assert S.forgetting_table([]) == "(no stage has ended yet)"
    assert S.forgetting_table(rows[:1]) == "(no stage has ended yet)"


def test_forgetting_rows_are_replaced_not_duplicated_when_a_resumed_run_measures_again(tmp_path):
    S.append_forgetting(str(tmp_path), [{"stage": 1, "at": "end", "domain": "logic", "kl": 0.5, "score": None},
                                        {"stage": 2, "at": "start", "domain": "math", "kl": 0.9, "score": None}])
    S.append_forgetting(str(tmp_path), [{"stage": 2, "at": "start", "domain": "math", "kl": 0.8, "score": None}])
    rows = S.read_forgetting(str(tmp_path))
    assert [(r["stage"], r["at"], r["domain"], r["kl"]) for r in rows] == [
        (1, "end", "logic", 0.5), (2, "start", "math", 0.8)]
    assert S.stage_end_rows(rows) == rows[:1]
    with pytest.raises(ValueError, match="'at' must be one of"):
        S.append_forgetting(str(tmp_path), [{"stage": 3, "at": "middle", "domain": "code", "kl": 0.1}])
    assert len(S.read_forgetting(str(tmp_path))) == 2  # a rejected row changes nothing


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
    assert S.taught_domains(steps, 1) == ["logic"]
    assert S.taught_domains(steps, 2) == ["math"]
    assert S.taught_domains(steps, 3) == []
    assert S.taught_domains(steps, 4) == ["code", "math"]


def test_one_update_per_plan_step_is_enforced_with_the_keys_named():
    S.check_one_update_per_step(32, 32, 1)
    with pytest.raises(ValueError, match=r"ppo_mini_batch_size=8 must equal mopd.block_size=32"):
        S.check_one_update_per_step(32, 8, 1)  # verl would run 4 AdamW steps per plan step
    with pytest.raises(ValueError, match=r"ppo_epochs"):
        S.check_one_update_per_step(32, 32, 2)
    assert S.check_teacher_dtype("fp32_bf16_autocast") == "fp32_bf16_autocast"
    with pytest.raises(ValueError, match="mopd.train.teacher_dtype"):
        S.check_teacher_dtype("fp16")


def test_resume_reconciles_recorded_and_existing_snapshots():
    # checkpoint in stage 3 (not complete) recorded M_1, M_2; all there -> nothing to do
    assert S.reconcile_snapshots([1, 2], [1, 2], 3, False) == ([], [], [])
    # M_2 recorded but deleted since: cannot be rebuilt
    assert S.reconcile_snapshots([1, 2], [1], 3, False) == ([2], [], [])
    # stage-3 end checkpoint, killed before its snapshot copy: rebuilt from the checkpoint
    assert S.reconcile_snapshots([1, 2], [1, 2], 3, True) == ([], [3], [])
    # a later run wrote M_3 and M_4 after this checkpoint (then was discarded): stale, not this run's M_j
    assert S.reconcile_snapshots([1, 2], [1, 2, 3, 4], 3, False) == ([], [], [3, 4])
    assert S.reconcile_snapshots([1, 2, 3], [1, 2, 3, 4], 3, True) == ([], [], [4])


def test_non_finite_grad_norm_marks_a_skipped_update_and_lost_stage_end_evaluations_are_found(tmp_path):
    assert S.skipped_update({"actor/grad_norm": float("nan")})
    assert S.skipped_update({"actor/grad_norm": float("inf")})
    assert not S.skipped_update({"actor/grad_norm": 3.0}) and not S.skipped_update({})
    rec = S.append_step(str(tmp_path), 4, {"stage": 1, "kind": "new", "domain": "logic", "block": 3,
                                           "teacher": "expert:logic"},
                        {"actor/grad_norm": float("nan"), "mopd/update_skipped": 1})
    assert rec["metrics"] == {"actor/grad_norm": None, "mopd/update_skipped": 1}
    rows = [{"stage": 1, "at": "end", "domain": "logic"}, {"stage": 2, "at": "start", "domain": "math"}]
    assert S.stage_end_measured(rows, 1) and not S.stage_end_measured(rows, 2)


def test_the_step_line_gives_the_stage_position_and_an_eta_from_this_process_steps():
    # stages of 4 steps (shared budget above); a clock that advances 10 s per step
    _, steps = _plan("shared")
    now = [0.0]
    progress = S.StageProgress(steps, S.stage_bounds(steps), clock_fn=lambda: now[0])
    progress.begin(2)
    lines = []
    for gs in (5, 6, 7, 8):
        now[0] += 10
        lines.append(progress.line(gs, {"mopd/kl_topk": 0.25, "mopd/adv_sigma": 1.5}))
    s = steps[4]
    assert lines[0] == (f"[mopd] step 5/12 stage 2/3: 1/4 steps (25%), 0:10 elapsed, ETA 0:30 | {s['kind']} "
                        f"{s['domain']} block {s['block']} teacher {s['teacher']}, kl_topk 0.2500, sigma 1.5")
    assert ", 0:20 elapsed, ETA 0:20 |" in lines[1] and "4/4 steps (100%), 0:40 elapsed |" in lines[3]
    # the benchmark times steps by the line's opening "[mopd] step N/L"
    assert [int(x.split("[mopd] step ", 1)[1].split("/", 1)[0]) for x in lines] == [5, 6, 7, 8]
    # resumed mid-stage at global step 7: the rate is this process's (1 step in 30 s), the position the plan's
    resumed = S.StageProgress(steps, S.stage_bounds(steps), clock_fn=lambda: now[0])
    resumed.begin(2)
    now[0] += 30
    assert "stage 2/3: 3/4 steps (75%), 0:30 elapsed, ETA 0:30 |" in resumed.line(7, {})
