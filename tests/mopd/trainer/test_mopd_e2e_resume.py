"""Kill in the middle of a stage, resume: the remaining steps and teachers are the plan's, the optimizer state of
the interrupted stage is restored (not reset), the re-run step reproduces the killed run's step exactly (same
responses, same teacher, same metrics), and the audit trail ends up equal to the plan. Slow: two verl runs.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.slow


def test_kill_mid_stage_and_resume_runs_the_remaining_plan(mopd_run, mopd_plan, fast):
    # run 1: stops after global step 6 (stage 2 = steps 5..7); checkpoints at 4 (stage end), 5 (save_freq), 6 (last)
    run_dir, _ = mopd_run("mopd/seq scale=tiny", "seq", *fast, "trainer.total_training_steps=6", "trainer.save_freq=5")
    assert [s["global_step"] for s in read_jsonl(run_dir / "steps.jsonl")] == [1, 2, 3, 4, 5, 6]
    # simulate a kill after step 6 ran but before its checkpoint was written
    shutil.rmtree(run_dir / "global_step_6")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("5")
    state = json.loads((run_dir / "global_step_5" / "mopd_state.json").read_text())
    assert state["stage"] == 2 and not state["stage_complete"] and state["snapshots"] == [1]

    # run 2: same recipe, full plan, trainer.resume_mode=auto (the recipes' default)
    run_dir, log = mopd_run("mopd/seq scale=tiny", "seq", *fast, "trainer.save_freq=5")
    assert "resumed at global step 5 (stage 2)" in log
    assert "optimizer state kept (resumed mid-stage)" in log
    steps = read_jsonl(run_dir / "steps.jsonl")
    plan = mopd_plan("mopd/seq scale=tiny")
    assert [{k: s[k] for k in plan[0]} for s in steps] == plan
    assert [s["global_step"] for s in steps] == list(range(1, 11))
    discarded = read_jsonl(run_dir / "steps.discarded.jsonl")
    assert [s["global_step"] for s in discarded] == [6]
    # exact resume: step 6 re-run from checkpoint 5 (weights, AdamW state, rollout RNG reseeded from the step)
    # samples the same responses and sees the same teacher as the killed run's step 6
    redo, lost = steps[5], discarded[0]
    assert {k: redo[k] for k in plan[0]} == {k: lost[k] for k in plan[0]}
    # actor/grad_norm: the docs/math.md §B.7 loss (per-micro-batch means) depends on which responses share a
    # micro-batch;
    # the trainer sorts each step's rows by content (canonical_row_order), so the rollout's completion order
    # cannot change it
    for key in ("response_length/mean", "mopd/kl_topk", "mopd/adv_sigma", "actor/grad_norm"):
        assert redo["metrics"][key] == pytest.approx(lost["metrics"][key], rel=1e-5, abs=1e-7), key
    counts = [s["metrics"]["mopd/optimizer_steps_in_stage"] for s in steps]
    # step 6 continues stage 2's restored AdamW (its state held 1 step), stage 3 starts fresh
    assert counts == [1, 2, 3, 4, 1, 2, 3, 1, 2, 3]
    assert (run_dir / "snapshots" / "student_3" / "config.json").exists()


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_resume_after_a_stage_end_reruns_the_lost_evaluation_and_sets_stale_snapshots_aside(mopd_run, mopd_plan,
                                                                                            fast):
    # run 1: stage 1 (steps 1..4) ends; checkpoint 4, snapshot M_1 and the stage-1 end evaluation are written
    fast = tuple(x for x in fast if not x.startswith("trainer.save_freq"))
    run_dir, _ = mopd_run("mopd/seq scale=tiny", "seq_eval", *fast, "trainer.total_training_steps=4",
                          "trainer.save_freq=-1")
    rows = read_jsonl(run_dir / "forgetting.jsonl")
    assert any(r["stage"] == 1 and r["at"] == "end" for r in rows)
    # a crash right after the checkpoint lost the evaluation; discarded later work left a snapshot M_2 behind
    kept = [r for r in rows if not (r["stage"] == 1 and r["at"] == "end")]
    (run_dir / "forgetting.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    shutil.copytree(run_dir / "snapshots" / "student_1", run_dir / "snapshots" / "student_2")
    state = json.loads((run_dir / "global_step_4" / "mopd_state.json").read_text())
    assert state["stage_complete"] and state["snapshots"] == [1]

    run_dir, log = mopd_run("mopd/seq scale=tiny", "seq_eval", *fast, "trainer.save_freq=-1")
    assert "resumed at global step 4 (stage 1)" in log
    assert "re-running its lost stage-end forgetting evaluation" in log
    assert "snapshot M_2 was not recorded by checkpoint 4" in log
    assert (run_dir / "snapshots" / "discarded" / "student_2.after_step_4" / "config.json").exists()
    rows = read_jsonl(run_dir / "forgetting.jsonl")
    ends = sorted((r["stage"], r["domain"]) for r in rows if r["at"] == "end")
    assert ends == [(1, "logic"), (2, "logic"), (2, "math"), (3, "code"), (3, "logic"), (3, "math")]
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [{k: s[k] for k in mopd_plan("mopd/seq scale=tiny")[0]} for s in steps] == mopd_plan("mopd/seq scale=tiny")
    assert (run_dir / "snapshots" / "student_2" / "config.json").exists()  # this run's own M_2
