"""Which teachers the MOPD workers hold: a stage's own (docs/math.md §B.1, the MOPD paper §3.1), or one expert for
the forgetting evaluation.

A stage loads exactly the teachers its steps use (checked against what the plan's setting lets it hold) and, on
its first step, gives the student a fresh AdamW state; a run resumed mid-stage keeps the checkpoint's optimizer.
"""

from __future__ import annotations

import logging
import os

from claas_verl.mopd.trainer.plan_steps import ModelPaths, check_held, stage_teachers

logger = logging.getLogger(__name__)


class StageTeachers:
    """The teachers loaded in the workers; ``stage`` is the stage whose set is loaded (None: none, or another set)."""

    def __init__(self, plan, plan_steps: list[dict], paths: ModelPaths, dtype: str, fresh_optimizer: bool,
                 also_previous: bool = False):
        self.plan, self.plan_steps, self.paths = plan, plan_steps, paths
        self.dtype = dtype
        self.fresh_optimizer = fresh_optimizer  # mopd.train.fresh_optimizer_per_stage
        self.also_previous = also_previous  # mopd.probe.enabled: every stage also holds M_{k-1}, the probe's reference
        self.stage: int | None = None

    def begin_stage(self, wg, stage: int, first_step: bool, global_steps: int) -> None:
        """Load ``stage``'s teachers into the worker group ``wg``; on its first step, reset the optimizer."""
        teachers = stage_teachers(self.plan_steps, stage)
        if self.also_previous and f"student:{stage - 1}" not in teachers:
            teachers.append(f"student:{stage - 1}")
        check_held(teachers, self.plan.held_by_stage[stage], stage, self.plan.setting)
        specs = {t: self.paths.path(t) for t in teachers}
        for name, path in specs.items():
            if not os.path.exists(os.path.join(path, "config.json")):
                raise ValueError(f"teacher {name} of stage {stage}: no Hugging Face model at {path}")
        loaded = wg.mopd_set_teachers(specs, self.dtype)[0]
        dropped = 0
        if first_step and self.fresh_optimizer:
            dropped = wg.mopd_reset_optimizer()[0]
        logger.info(f"MOPD stage {stage}: teachers {loaded}; fresh optimizer={first_step} (dropped {dropped})")
        print(f"[mopd] stage {stage} begins at global step {global_steps}: teachers {loaded}"
              + (", fresh AdamW state" if first_step else ", optimizer state kept (resumed mid-stage)"))
        self.stage = stage

    def load_expert(self, wg, domain: str) -> str:
        """Hold only ``domain``'s expert (the forgetting evaluation); the next step reloads its stage's teachers."""
        name = f"expert:{domain}"
        wg.mopd_set_teachers({name: self.paths.path(name)}, self.dtype)
        self.stage = None
        return name
