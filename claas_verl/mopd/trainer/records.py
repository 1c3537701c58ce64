"""Records of a continual MOPD run: plan position, teachers, snapshots, audit trail, resume state, forgetting table.

Pure python (no verl, no ray, no torch), so every rule here is unit-tested directly:

* **Plan position.** verl counts ``global_steps`` from 1; plan step ``i`` (0-based) runs at global step
  ``i + 1``. Nothing else is needed to find the step after a resume.
* **Teachers.** ``expert:<d>`` is ``mopd.domains.<d>.expert``; ``student:0`` is ``mopd.student`` (π_0);
  ``student:<j>`` is the stage-final snapshot ``<run>/snapshots/student_<j>`` (M_j), written in Hugging Face
  format when stage j ends.
* **Models held.** A stage loads exactly the teachers its steps use; the plan's ``held_by_stage`` (what the
  setting allows to exist) is checked against them (MOPD paper §3.1: S1 holds E_k and M_{k-1}).
* **Audit trail.** ``<run>/steps.jsonl`` holds one JSON object per executed step: the plan fields
  (``stage, kind, domain, block, teacher``, same vocabulary as ``python -m claas_verl.plan plan.format=json``)
  plus ``global_step`` and the step's metrics. On resume, lines after the resumed step are moved to
  ``steps.discarded.jsonl`` (they belong to work that the checkpoint does not contain).
* **Resume state.** ``<run>/global_step_<N>/mopd_state.json`` next to verl's own checkpoint files: plan
  position, stage, the snapshots that exist and a fingerprint of the plan (a resumed run must run the same plan).
* **Forgetting table.** ``<run>/forgetting.jsonl``: one row per stage end and learned domain (``at: "end"``)
  plus, before each stage's first update, one row per domain the stage teaches (``at: "start"``), so a user sees
  both what a stage learned (start -> end KL to its expert) and what later stages forgot. ``forgetting.md`` holds
  both tables.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from claas_verl.mopd.config_train import TEACHER_DTYPES, check_teacher_dtype  # noqa: F401 (the config layer's)
from claas_verl.utils.files import atomic_write_text
from claas_verl.utils.progress import clock

STEPS_FILE = "steps.jsonl"
DISCARDED_FILE = "steps.discarded.jsonl"
STATE_FILE = "mopd_state.json"
FORGETTING_JSONL = "forgetting.jsonl"
FORGETTING_MD = "forgetting.md"
SNAPSHOT_DIR = "snapshots"
PLAN_KEYS = ("stage", "kind", "domain", "block", "teacher")


def check_one_update_per_step(block_size: int, ppo_mini_batch_size, ppo_epochs) -> None:
    """docs/math.md §B.1: every plan step makes exactly ONE optimizer update (one epoch, one mini-batch of the block).

    verl runs ``ppo_epochs × block/ppo_mini_batch_size`` AdamW steps per ``update_actor``; anything but one
    mini-batch of the whole block and one epoch would silently take several steps per plan step.
    """
    if ppo_mini_batch_size is None or int(ppo_mini_batch_size) != int(block_size):
        raise ValueError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={ppo_mini_batch_size} must equal mopd.block_size="
            f"{block_size}: one optimizer update per plan step (docs/math.md §B.1); "
            "a smaller value makes verl run several "
            "AdamW steps per step (the MOPD recipes set it to ${mopd.block_size})"
        )
    if ppo_epochs is None or int(ppo_epochs) != 1:
        raise ValueError(f"actor_rollout_ref.actor.ppo_epochs (mopd.train.ppo_epochs)={ppo_epochs} must be 1: one "
                         "optimizer update per plan step (docs/math.md §B.1)")


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


# ---------------------------------------------------------------------------------------------- audit trail
def _jsonable(v: Any) -> Any:
    """Numbers stay numbers (NaN/inf -> null, which JSON lacks), None stays null, anything else becomes text."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None


def append_step(run_dir: str, global_step: int, plan_step: dict, metrics: dict[str, Any]) -> dict:
    """Append one executed step to ``steps.jsonl``; returns the record."""
    rec = {k: plan_step[k] for k in PLAN_KEYS}
    rec["global_step"] = int(global_step)
    rec["metrics"] = {k: _jsonable(v) for k, v in sorted(metrics.items())}
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, STEPS_FILE), "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def read_steps(run_dir: str) -> list[dict]:
    path = Path(run_dir) / STEPS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_steps(run_dir: str, keep_upto_global_step: int) -> int:
    """Keep the records with ``global_step <= keep_upto``; move the rest to ``steps.discarded.jsonl``."""
    records = read_steps(run_dir)
    keep = [r for r in records if r["global_step"] <= keep_upto_global_step]
    drop = [r for r in records if r["global_step"] > keep_upto_global_step]
    if drop:
        with open(os.path.join(run_dir, DISCARDED_FILE), "a") as f:
            for r in drop:
                f.write(json.dumps(r) + "\n")
    if records:
        with open(os.path.join(run_dir, STEPS_FILE), "w") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")
    return len(drop)


# ---------------------------------------------------------------------------------------------- resume state
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


def skipped_update(metrics: dict[str, Any]) -> bool:
    """verl skips the AdamW step (and zeroes the gradients) when the gradient norm is not finite."""
    g = metrics.get("actor/grad_norm")
    try:
        return g is not None and not math.isfinite(float(g))
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------- forgetting
FORGETTING_POINTS = ("start", "end")


def stage_end_measured(rows: list[dict], stage: int) -> bool:
    """Whether ``forgetting.jsonl`` holds the stage-end evaluation of ``stage`` (a crash can lose it)."""
    return any(int(r["stage"]) == stage and r.get("at", "end") == "end" for r in rows)


def _forgetting_key(r: dict) -> tuple:
    return int(r["stage"]), r.get("at", "end"), r["domain"]


def append_forgetting(run_dir: str, rows: list[dict]) -> None:
    """Add rows (each with ``stage``, ``at`` in {start, end}, ``domain``, ``kl``, ``score``, ``global_step``).

    A row replaces an earlier one with the same ``(stage, at, domain)``: a run resumed from the checkpoint before
    an evaluation evaluates again, and the table must hold one measurement per cell, the one that the resumed
    run's weights produced.
    """
    for r in rows:
        if r.get("at", "end") not in FORGETTING_POINTS:
            raise ValueError(f"forgetting row 'at' must be one of {FORGETTING_POINTS}, got {r.get('at')!r}")
    os.makedirs(run_dir, exist_ok=True)  # the first stage-start rows come before verl's first checkpoint
    new_keys = {_forgetting_key(r) for r in rows}
    kept = [r for r in read_forgetting(run_dir) if _forgetting_key(r) not in new_keys]
    lines = [json.dumps({k: _jsonable(v) if k not in ("domain", "label", "at") else v for k, v in r.items()}) + "\n"
             for r in [*kept, *rows]]
    atomic_write_text(os.path.join(run_dir, FORGETTING_JSONL), "".join(lines))


def read_forgetting(run_dir: str) -> list[dict]:
    path = Path(run_dir) / FORGETTING_JSONL
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stage_end_rows(rows: list[dict]) -> list[dict]:
    """The rows measured on stage-final students (the forgetting table proper)."""
    return [r for r in rows if r.get("at", "end") == "end"]


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    kl, score = r.get("kl"), r.get("score")
    txt = "nan" if kl is None else f"{kl:.4f}"
    return txt if score is None else f"{txt} ({score:.2f})"


def forgetting_table(rows: list[dict], title: str = "") -> str:
    """Markdown: the forgetting table (one line per stage end, one column per domain, cells ``KL (score)``), then,
    when start rows exist, what each stage learned (KL to the taught domain's expert at its start and end).

    ``KL`` is the mean student-weighted top-k KL from the student to the domain's expert on the domain's held-out
    prompts, on the student's own samples (lower is better; it can be negative, since the weights are renormalised
    over the top-k); ``score`` is the mean reward when the domain has one. Rows that carry ``kl_binned`` (the
    (k+1)-bin KL, a non-negative lower bound of the full-vocabulary KL) show it in the start/end table.
    """
    ends = stage_end_rows(rows)
    if not ends:
        return "(no stage has ended yet)"
    domains: list[str] = []
    for r in ends:
        if r["domain"] not in domains:
            domains.append(r["domain"])
    cell = {(int(r["stage"]), r["domain"]): r for r in ends}
    lines = [f"### {title}"] if title else []
    lines.append("| after stage | " + " | ".join(f"KL to E[{d}] (score)" for d in domains) + " |")
    lines.append("|---|" + "---|" * len(domains))
    for st in sorted({int(r["stage"]) for r in ends}):
        lines.append(f"| {st} | " + " | ".join(_cell(cell.get((st, d))) for d in domains) + " |")
    starts = [r for r in rows if r.get("at") == "start"]
    if starts:
        lines += ["", "| stage | taught domain | KL to its expert at stage start | at stage end | change "
                      "| (k+1)-bin KL start → end |", "|---|---|---|---|---|---|"]
        for r in starts:
            end = cell.get((int(r["stage"]), r["domain"]))
            both = {k: end is not None and end.get(k) is not None and r.get(k) is not None for k in ("kl", "kl_binned")}
            change = f"{end['kl'] - r['kl']:+.4f}" if both["kl"] else ""
            binned = f"{r['kl_binned']:.4f} → {end['kl_binned']:.4f}" if both["kl_binned"] else ""
            lines.append(f"| {r['stage']} | {r['domain']} | {_cell(r)} | {_cell(end)} | {change} | {binned} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- console
class StageProgress:
    """One console line per executed step with the stage's position and ETA (the rate of this process's steps in
    the stage)::

        [mopd] step 26/72 stage 2/3: 14/36 steps (39%), 1:05 elapsed, ETA 1:40 | replay reverse block 3, kl_topk 0.12

    ``[mopd] step N/L`` opens the line (``benchmarks/bench_mopd_step.py`` times the steps by it)."""

    def __init__(self, plan_steps: list[dict], bounds: dict[int, tuple[int, int]], clock_fn=time.monotonic):
        self.plan_steps, self.bounds = plan_steps, bounds
        self._clock = clock_fn
        self._stage: int | None = None
        self._start = 0.0
        self._ran = 0  # steps of the stage this process ran (a resumed stage counts from the resume)

    def begin(self, stage: int) -> None:
        """``stage``'s first step in this process (a new stage, or the first step after a resume) starts now."""
        self._stage, self._start, self._ran = stage, self._clock(), 0

    def line(self, global_step: int, metrics: dict[str, Any]) -> str:
        i = step_index(global_step, len(self.plan_steps))
        step = self.plan_steps[i]
        first, last = self.bounds[step["stage"]]
        if self._stage != step["stage"]:
            self.begin(step["stage"])
        now = self._clock()
        self._ran += 1
        done, total = i - first + 1, last - first + 1
        elapsed = now - self._start
        eta = f", ETA {clock(elapsed / self._ran * (total - done))}" if done < total else ""
        return (f"[mopd] step {global_step}/{len(self.plan_steps)} stage {step['stage']}/{max(self.bounds)}: "
                f"{done}/{total} steps ({100 * done / total:.0f}%), {clock(elapsed)} elapsed{eta} | "
                f"{step['kind']} {step['domain']} block {step['block']} teacher {step['teacher']}, "
                f"kl_topk {metrics.get('mopd/kl_topk', float('nan')):.4f}, "
                f"sigma {metrics.get('mopd/adv_sigma', float('nan')):.4g}")
