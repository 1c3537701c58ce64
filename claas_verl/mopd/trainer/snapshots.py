"""Stage-final students M_j and the resume state beside verl's checkpoints.

At every checkpoint the trainer writes ``mopd_state.json`` into verl's ``global_step_N`` folder (plan position,
stage, the snapshots that exist, the plan's fingerprint); at a stage end it first copies the checkpoint's Hugging
Face export to ``<run>/snapshots/student_<stage>`` (M_stage, the teacher ``student:<stage>`` of later stages), since
verl may rotate the checkpoint away. On resume the snapshots on disk are reconciled with those the checkpoint
recorded (:func:`claas_verl.mopd.trainer.resume_state.reconcile_snapshots`) and the audit trail is cut back to it.
"""

from __future__ import annotations

import os
import shutil

from claas_verl.mopd.trainer.audit_trail import truncate_steps
from claas_verl.mopd.trainer.plan_steps import ModelPaths, plan_fingerprint
from claas_verl.mopd.trainer.resume_state import (
    STATE_FILE,
    existing_snapshots,
    read_state,
    reconcile_snapshots,
    write_state,
)

CARRIED_STATE_KEY = "carried_balance"  # the worker's carried multipliers (mopd.signal.balance: carried) in the state


class StageSnapshots:
    """M_j export, resume state and its reconciliation for one run directory."""

    def __init__(self, paths: ModelPaths, plan_steps: list[dict], bounds: dict[int, tuple[int, int]]):
        self.paths, self.plan_steps, self.bounds = paths, plan_steps, bounds
        self.run_dir = paths.run_dir

    def step_dir(self, gs: int) -> str:
        return os.path.join(self.run_dir, f"global_step_{gs}")

    def after_save(self, gs: int, stage: int, stage_complete: bool, extra: dict | None = None) -> None:
        """After verl saved global step ``gs``: export M_stage at a stage end, then write the resume state (with
        ``extra``: worker state verl's checkpoint does not hold, e.g. the carried balancing multipliers)."""
        if stage_complete:
            self.export(stage, gs)
        write_state(self.step_dir(gs), {
            **(extra or {}),
            "global_step": gs,
            "plan_index": gs - 1,
            "stage": stage,
            "stage_complete": stage_complete,
            "snapshots": existing_snapshots(self.paths, max(self.bounds)),
            "plan_fingerprint": plan_fingerprint(self.plan_steps),
            "plan_length": len(self.plan_steps),
        })

    def export(self, stage: int, gs: int) -> None:
        """M_stage in Hugging Face format, copied out of verl's checkpoint (which may be rotated away later)."""
        src = os.path.join(self.step_dir(gs), "actor", "huggingface")
        if not os.path.exists(os.path.join(src, "config.json")):
            raise ValueError(
                f"no Hugging Face export in {src}: add 'hf_model' to "
                "actor_rollout_ref.actor.checkpoint.save_contents (the MOPD recipes do)"
            )
        dst = self.paths.snapshot(stage)
        tmp = dst + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(tmp, dst)
        print(f"[mopd] stage {stage} ends: snapshot M_{stage} -> {dst}")

    def resume(self, gs: int) -> dict:
        """After verl loaded global step ``gs``: check the checkpoint is this plan's, rebuild or set aside the
        snapshots the checkpoint does not match, cut the audit trail back; returns the checkpoint's resume state."""
        state = read_state(self.step_dir(gs))
        if state is None:
            raise ValueError(f"{self.step_dir(gs)} has no {STATE_FILE}: not a MOPD checkpoint")
        if state["plan_fingerprint"] != plan_fingerprint(self.plan_steps):
            raise ValueError(
                f"the checkpoint {self.step_dir(gs)} was written for a different plan; resume with the same recipe "
                "or set trainer.resume_mode=disable"
            )
        existing = existing_snapshots(self.paths, max(self.bounds))
        missing, recopy, stale = reconcile_snapshots(state.get("snapshots", []), existing, state["stage"],
                                                     state["stage_complete"])
        if missing:
            raise ValueError(
                f"the checkpoint {self.step_dir(gs)} recorded stage snapshots {state.get('snapshots')} but "
                f"{missing} are gone from {os.path.dirname(self.paths.snapshot(1))}: restore them or resume from an "
                "earlier checkpoint (trainer.resume_from_path)"
            )
        for j in recopy:
            self.export(j, gs)  # killed between the save and the copy
        for j in stale:  # written by work after this checkpoint: this run makes its own M_j again
            src = self.paths.snapshot(j)
            dst = os.path.join(os.path.dirname(src), "discarded", f"student_{j}.after_step_{gs}")
            shutil.rmtree(dst, ignore_errors=True)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            print(f"[mopd] snapshot M_{j} was not recorded by checkpoint {gs} (later, discarded work): moved to {dst}")
        dropped = truncate_steps(self.run_dir, gs)
        print(f"[mopd] resumed at global step {gs} (stage {state['stage']}); {dropped} later audit lines discarded")
        return state
