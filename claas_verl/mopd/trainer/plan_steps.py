"""Where a continual MOPD run stands in its plan, and which models each stage holds.

Pure python (no verl, no ray, no torch), so every rule here is unit-tested directly:

* **Plan position.** verl counts ``global_steps`` from 1; plan step ``i`` (0-based) runs at global step
  ``i + 1``. Nothing else is needed to find the step after a resume.
* **Teachers.** ``expert:<d>`` is ``mopd.domains.<d>.expert``; ``student:0`` is ``mopd.student`` (π_0);
  ``student:<j>`` is the stage-final snapshot ``<run>/snapshots/student_<j>`` (M_j), written in Hugging Face
  format when stage j ends.
* **Models held.** A stage loads exactly the teachers its steps use; the plan's ``held_by_stage`` (what the
  setting allows to exist) is checked against them (MOPD paper §3.1: S1 holds E_k and M_{k-1}).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

SNAPSHOT_DIR = "snapshots"
# the fields of a plan step, same vocabulary as ``python -m claas_verl.plan plan.format=json``
PLAN_KEYS = ("stage", "kind", "domain", "block", "teacher")


def plan_fingerprint(plan_steps: list[dict]) -> str:
    """sha256 of the plan's JSON steps (order matters); a resume checks it so a changed recipe cannot resume."""
    blob = json.dumps([{k: s[k] for k in PLAN_KEYS} for s in plan_steps], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def step_index(global_step: int, num_steps: int) -> int:
    """0-based plan index of verl's 1-based ``global_step``; raises past the end of the plan."""
    if not 1 <= global_step <= num_steps:
        raise ValueError(
            f"global step {global_step} is outside the plan's {num_steps} steps; trainer.total_training_steps "
            f"must not exceed the plan length (python -m claas_verl.plan shows it)"
        )
    return global_step - 1


@dataclass(frozen=True)
class ModelPaths:
    """Where each plan model name lives: experts and π_0 from the recipe, M_j under the run directory."""

    student0: str
    experts: dict[str, str]
    run_dir: str

    def snapshot(self, stage: int) -> str:
        return os.path.join(self.run_dir, SNAPSHOT_DIR, f"student_{stage}")

    def path(self, name: str) -> str:
        kind, _, arg = name.partition(":")
        if kind == "expert":
            if arg not in self.experts or not self.experts[arg] or self.experts[arg] == "???":
                raise ValueError(f"mopd.domains.{arg}.expert: no path for teacher {name!r}; set it in the recipe")
            return self.experts[arg]
        if kind == "student":
            j = int(arg)
            return self.student0 if j == 0 else self.snapshot(j)
        raise ValueError(f"unknown model name {name!r} (expected expert:<domain> or student:<stage>)")


def stage_teachers(plan_steps: list[dict], stage: int) -> list[str]:
    """Teachers used by the steps of ``stage``, in first-use order."""
    seen: list[str] = []
    for s in plan_steps:
        if s["stage"] == stage and s["teacher"] not in seen:
            seen.append(s["teacher"])
    return seen


def check_held(teachers: list[str], held: tuple[str, ...] | list[str], stage: int, setting: str) -> None:
    """Raise if a stage would load a teacher its setting does not let it hold."""
    extra = [t for t in teachers if t not in held]
    if extra:
        raise ValueError(
            f"stage {stage} would load {extra} but mopd.setting={setting} holds only {list(held)} at that stage"
        )


def stage_bounds(plan_steps: list[dict]) -> dict[int, tuple[int, int]]:
    """stage -> (first, last) 0-based plan index."""
    out: dict[int, tuple[int, int]] = {}
    for i, s in enumerate(plan_steps):
        first, _ = out.get(s["stage"], (i, i))
        out[s["stage"]] = (first, i)
    return out


def taught_domains(plan_steps: list[dict], stage: int) -> list[str]:
    """Domains a stage learns from their experts (``new`` steps; every domain in joint MOPD), first-seen order.

    Replay and recovery steps are not counted: they keep old domains, which the stage-end rows already track.
    """
    seen: list[str] = []
    for s in plan_steps:
        if s["stage"] == stage and s["kind"] in ("new", "joint") and s["domain"] not in seen:
            seen.append(s["domain"])
    return seen


def learned_domains(plan_steps: list[dict], upto_index: int) -> list[str]:
    """Domains trained on by plan steps 0..upto_index, in first-seen order."""
    seen: list[str] = []
    for s in plan_steps[: upto_index + 1]:
        if s["domain"] not in seen:
            seen.append(s["domain"])
    return seen
