"""The resume state of a continual MOPD run: ``<run>/global_step_<N>/mopd_state.json`` beside verl's checkpoint.

It holds the plan position, the stage, the snapshots that exist and a fingerprint of the plan (a resumed run must
run the same plan); on resume the snapshots on disk are reconciled with those it recorded. Pure python (no verl,
no ray, no torch).
"""

from __future__ import annotations

import json
import os

from claas_verl.mopd.trainer.plan_steps import ModelPaths
from claas_verl.utils.files import atomic_write_text

STATE_FILE = "mopd_state.json"


def write_state(step_dir: str, state: dict) -> str:
    os.makedirs(step_dir, exist_ok=True)
    path = os.path.join(step_dir, STATE_FILE)
    atomic_write_text(path, json.dumps(state, indent=1, sort_keys=True))  # a kill mid-write keeps the previous file
    return path


def read_state(step_dir: str) -> dict | None:
    path = os.path.join(step_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def existing_snapshots(paths: ModelPaths, max_stage: int) -> list[int]:
    return [j for j in range(1, max_stage + 1) if os.path.exists(os.path.join(paths.snapshot(j), "config.json"))]


def reconcile_snapshots(recorded: list[int], existing: list[int], stage: int, stage_complete: bool
                        ) -> tuple[list[int], list[int], list[int]]:
    """Resume: compare the snapshots a checkpoint recorded with those on disk.

    Returns ``(missing, recopy, stale)``: ``missing`` = snapshots the resumed run needs (every finished stage's
    M_j, recorded or required) that are gone and cannot be rebuilt; ``recopy`` = the checkpoint's own stage
    snapshot when the run was killed between the save and the copy (rebuilt from the checkpoint's HF export);
    ``stale`` = snapshots on disk the checkpoint did not record, of stages the resumed run will run again (left by
    work after the checkpoint; they must not be taken for this run's M_j).
    """
    finished = set(range(1, stage + (1 if stage_complete else 0)))
    gone = sorted((set(recorded) | finished) - set(existing))
    recopy = [j for j in gone if stage_complete and j == stage]
    missing = [j for j in gone if j not in recopy]
    stale = sorted(j for j in set(existing) - set(recorded) if j not in finished)
    return missing, recopy, stale
