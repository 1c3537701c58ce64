"""Resume state and snapshot reconciliation (claas_verl.mopd.trainer.resume_state): pure python, hand-checked cases."""

from __future__ import annotations

from claas_verl.mopd.trainer.plan_steps import ModelPaths
from claas_verl.mopd.trainer.resume_state import (
    STATE_FILE,
    existing_snapshots,
    read_state,
    reconcile_snapshots,
    write_state,
)


def test_state_round_trip_is_atomic(tmp_path):
    assert read_state(str(tmp_path / "global_step_3")) is None
    write_state(str(tmp_path / "global_step_3"), {"stage": 2, "snapshots": [1]})
    assert read_state(str(tmp_path / "global_step_3")) == {"stage": 2, "snapshots": [1]}
    assert not (tmp_path / "global_step_3" / (STATE_FILE + ".tmp")).exists()


def test_existing_snapshots(tmp_path):
    paths = ModelPaths(student0="/m", experts={}, run_dir=str(tmp_path))
    (tmp_path / "snapshots" / "student_2").mkdir(parents=True)
    (tmp_path / "snapshots" / "student_2" / "config.json").write_text("{}")
    (tmp_path / "snapshots" / "student_1").mkdir(parents=True)  # no config.json: an interrupted copy
    assert existing_snapshots(paths, 3) == [2]


def test_resume_reconciles_recorded_and_existing_snapshots():
    # checkpoint in stage 3 (not complete) recorded M_1, M_2; all there -> nothing to do
    assert reconcile_snapshots([1, 2], [1, 2], 3, False) == ([], [], [])
    # M_2 recorded but deleted since: cannot be rebuilt
    assert reconcile_snapshots([1, 2], [1], 3, False) == ([2], [], [])
    # stage-3 end checkpoint, killed before its snapshot copy: rebuilt from the checkpoint
    assert reconcile_snapshots([1, 2], [1, 2], 3, True) == ([], [3], [])
    # a later run wrote M_3 and M_4 after this checkpoint (then was discarded): stale, not this run's M_j
    assert reconcile_snapshots([1, 2], [1, 2, 3, 4], 3, False) == ([], [], [3, 4])
    assert reconcile_snapshots([1, 2, 3], [1, 2, 3, 4], 3, True) == ([], [], [4])
