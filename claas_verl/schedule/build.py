"""From a validated ``ScheduleConfig`` to a ``Plan``, and the check of a plan against its setting."""

from __future__ import annotations

from dataclasses import replace

from claas_verl.schedule.config import ScheduleConfig
from claas_verl.schedule.joint import joint_steps
from claas_verl.schedule.plan import Plan, Step, expert, student
from claas_verl.schedule.recovery import recovery_steps
from claas_verl.schedule.segments import segment_bounds, segmented_steps
from claas_verl.schedule.sequence import sequence_steps


def build_plan(cfg: ScheduleConfig) -> Plan:
    """The full plan of ``cfg`` (docs/math.md §B.8), checked against ``cfg.setting``."""
    nb = cfg.num_blocks
    r = cfg.replay
    if cfg.joint.enabled:
        steps = joint_steps(cfg.joint_order, nb, passes=cfg.joint.passes)
    elif cfg.segment_size is not None:
        steps = segmented_steps(
            cfg.order, nb, cfg.segment_size, cfg.budget, r.m, r.b, r.fixed_from_stage,
            cfg.recovery.blocks_per_domain, cfg.recovery.teachers, r.cycle,
        )
    else:
        steps = sequence_steps(cfg.order, nb, cfg.budget, m=r.m, b=r.b, f=r.fixed_from_stage, cycle=r.cycle)
        if cfg.recovery.enabled:
            K = len(cfg.order)
            if cfg.recovery.teachers == "experts":
                teacher_of = {d: expert(d) for d in cfg.order}
            else:  # stage-final students; the last domain's is M_K, the model the recovery starts from
                teacher_of = {d: student(k) for k, d in enumerate(cfg.order, start=1)}
            steps += recovery_steps(K + 1, list(cfg.order), nb, cfg.recovery.blocks_per_domain, teacher_of)
    if cfg.replay.teachers == "experts":  # the deviation of ReplayConfig.teachers: E_j instead of M_{k-1}
        steps = [replace(s, teacher=expert(s.domain)) if s.kind == "replay" else s for s in steps]
    plan = Plan(steps=tuple(steps), order=cfg.order, num_blocks=nb, setting=cfg.setting)
    check_plan_setting(plan, segment_size=cfg.segment_size)
    return plan


def allowed_models(plan: Plan, stage: int, segment_size: int | None = None) -> set[str] | None:
    """Models the setting lets stage ``stage`` hold (besides the trained student); None = no limit.

    S1 (MOPD paper §3.1): at domain stage k only E_k and M_{k-1}. S2: anything. S3: S2 inside a segment and S1
    between segments: the experts and snapshots of the current segment plus the last consolidated model
    (the model the segment started from).
    """
    if plan.setting == "S2":
        return None
    steps = plan.stage_steps(stage)
    new_domains = {s.domain for s in steps if s.kind == "new"}
    if plan.setting == "S1":
        return {student(stage - 1)} | {expert(d) for d in new_domains}
    # S3: find the segment this stage belongs to; stages run segment by segment, recovery last.
    assert segment_size is not None
    first = 1
    for start, end in segment_bounds(len(plan.order), segment_size):
        last = first + (end - start)  # the segment's recovery stage
        if first <= stage <= last:
            seg_domains = plan.order[start:end]
            return ({student(s) for s in range(first - 1, last)}
                    | {expert(d) for d in seg_domains})
        first = last + 1
    raise ValueError(f"stage {stage} lies outside every segment")


def check_plan_setting(plan: Plan, segment_size: int | None = None) -> None:
    """Raise if some stage must hold a model its setting does not keep (a safety net behind check_setting)."""
    for stage in plan.stages:
        allowed = allowed_models(plan, stage, segment_size)
        if allowed is None:
            continue
        extra = [m for m in plan.held_by_stage[stage] if m not in allowed]
        if extra:
            raise ValueError(
                f"mopd.setting={plan.setting}: stage {stage} would have to keep {extra}, which "
                f"{plan.setting} does not keep (allowed: {sorted(allowed)}); change the schedule or the setting"
            )


__all__ = ["build_plan", "check_plan_setting", "allowed_models", "Step"]
