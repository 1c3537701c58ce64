"""The plan of a continual run: ordered steps, their teachers, and the models each step needs kept.

A ``Step`` trains one block of one domain (docs/math.md §B.8). Teachers are named ``expert:<domain>`` (E_d) or
``student:<stage>`` (M_stage, the student at the END of that stage; ``student:0`` is pi_0). Stages are
numbered in execution order, so stage s always starts from ``student:<s-1>``; the recovery stage after
K domain stages is K+1. Joint MOPD is the single stage 1 (it starts from pi_0 = student:0).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

KINDS = ("new", "replay", "recovery", "joint")


def expert(domain: str) -> str:
    return f"expert:{domain}"


def student(stage: int) -> str:
    return f"student:{stage}"


@dataclass(frozen=True)
class Step:
    stage: int
    kind: str  # one of KINDS
    domain: str
    block: int  # 0-based index of the block within its domain (B.8: order of the domain's own stage)
    teacher: str  # expert:<domain> | student:<stage>

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Step.kind must be one of {KINDS}, got {self.kind!r}")
        if self.block < 0:
            raise ValueError(f"Step.block must be >= 0, got {self.block}")

    def to_dict(self) -> dict:
        return {"stage": self.stage, "kind": self.kind, "domain": self.domain, "block": self.block,
                "teacher": self.teacher}


@dataclass(frozen=True)
class Plan:
    """Steps in execution order plus what must be kept. Build it with ``claas_verl.schedule.build_plan``."""

    steps: tuple[Step, ...]
    order: tuple[str, ...]  # domains in sequence order
    num_blocks: dict[str, int]
    setting: str = "S1"
    held_by_stage: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.held_by_stage:
            object.__setattr__(self, "held_by_stage", compute_held(self.steps, self.order))
        for s in self.steps:
            if s.domain not in self.num_blocks:
                raise ValueError(f"plan step {s} names unknown domain {s.domain!r}")
            if s.block >= self.num_blocks[s.domain]:
                raise ValueError(f"plan step {s} uses block {s.block} of {self.num_blocks[s.domain]}")

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.steps)

    @property
    def stages(self) -> list[int]:
        return sorted({s.stage for s in self.steps})

    def held(self, index: int) -> tuple[str, ...]:
        """Models that must exist (loaded or stored) while step ``index`` runs, besides the trained student."""
        return self.held_by_stage[self.steps[index].stage]

    def stage_steps(self, stage: int) -> list[Step]:
        return [s for s in self.steps if s.stage == stage]

    def blocks(self, stage: int, kind: str, domain: str) -> list[int]:
        """Blocks of ``domain`` used by ``kind`` steps of ``stage``, in execution order (Table 7's cells)."""
        return [s.block for s in self.steps if s.stage == stage and s.kind == kind and s.domain == domain]

    def to_json_dict(self) -> dict:
        return {"steps": [s.to_dict() for s in self.steps]}

    # ------------------------------------------------------------------ text
    def summary(self) -> str:
        """Readable per-stage summary: new and replay steps, replay per earlier domain, teachers, models kept."""
        lines = [
            f"MOPD plan: setting {self.setting}, {len(self.order)} domains ({', '.join(self.order)}), "
            f"{len(self.steps)} steps",
            "blocks per domain: " + ", ".join(f"{d}={self.num_blocks[d]}" for d in self.order),
        ]
        for stage in self.stages:
            steps = self.stage_steps(stage)
            kinds = Counter(s.kind for s in steps)
            label = _stage_label(steps)
            counts = ", ".join(f"{kinds[k]} {k}" for k in KINDS if kinds[k])
            lines.append(f"stage {stage} [{label}]: {len(steps)} steps ({counts}), starts from {student(stage - 1)}")
            for kind in ("replay", "recovery", "joint"):
                per_domain = Counter(s.domain for s in steps if s.kind == kind)
                if per_domain:
                    parts = []
                    for d in self.order:
                        if per_domain[d]:
                            blocks = self.blocks(stage, kind, d)
                            parts.append(f"{d} {per_domain[d]} {blocks}")
                    lines.append(f"  {kind} per domain: " + "; ".join(parts))
            teachers = _ordered({s.teacher for s in steps}, self.order)
            lines.append(f"  teachers: {', '.join(teachers)}")
            lines.append(f"  models kept: {', '.join(self.held_by_stage[stage])}")
        totals = Counter(s.kind for s in self.steps)
        lines.append("total: " + ", ".join(f"{totals[k]} {k}" for k in KINDS if totals[k]) + f" = {len(self.steps)}")
        return "\n".join(lines)


def _stage_label(steps: list[Step]) -> str:
    kinds = {s.kind for s in steps}
    if "new" in kinds:
        return next(s.domain for s in steps if s.kind == "new")
    return "/".join(sorted(kinds))


def _ordered(models: set[str], order: tuple[str, ...]) -> list[str]:
    """Experts in domain order, then students by stage: a stable, readable order for model lists."""
    def key(m: str) -> tuple[int, int]:
        kind, _, name = m.partition(":")
        if kind == "expert":
            return (0, order.index(name) if name in order else len(order))
        return (1, int(name))
    return sorted(models, key=key)


def compute_held(steps: tuple[Step, ...] | list[Step], order: tuple[str, ...]) -> dict[int, tuple[str, ...]]:
    """Models each stage must hold: its start model, its teachers, and already-available later teachers.

    A stage s holds ``student:<s-1>`` (it starts from it), every teacher of its own steps, and every
    teacher of a LATER stage that already exists at s and so must be stored until then: a student
    ``student:j`` exists from stage j+1 on, an expert from the first stage that uses it (experts arrive
    with their domain). This yields MOPD paper §3.1: S1 replay keeps {E_k, M_{k-1}}; Seq+Recovery keeps
    M_1..M_{k-1} through stage k and M_1..M_K in the recovery; joint MOPD holds every expert.
    """
    stages = sorted({s.stage for s in steps})
    teachers: dict[int, set[str]] = {st: set() for st in stages}
    first_use: dict[str, int] = {}
    for s in steps:
        teachers[s.stage].add(s.teacher)
        if s.teacher.startswith("expert:"):
            first_use.setdefault(s.teacher, s.stage)

    def exists_at(model: str, stage: int) -> bool:
        if model.startswith("student:"):
            return int(model.split(":", 1)[1]) < stage
        return first_use[model] <= stage

    held: dict[int, tuple[str, ...]] = {}
    for i, st in enumerate(stages):
        keep = {student(st - 1)} | teachers[st]
        for later in stages[i + 1:]:
            keep |= {m for m in teachers[later] if exists_at(m, st)}
        held[st] = tuple(_ordered(keep, order))
    return held
