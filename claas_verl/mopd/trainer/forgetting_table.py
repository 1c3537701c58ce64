"""The forgetting table of a continual MOPD run: ``<run>/forgetting.jsonl`` and ``forgetting.md``.

One row per stage end and learned domain (``at: "end"``) plus, before each stage's first update, one row per
domain the stage teaches (``at: "start"``), so a user sees both what a stage learned (start -> end KL to its
expert) and what later stages forgot. ``forgetting.md`` holds both tables. Pure python (no verl, no ray, no torch);
:mod:`claas_verl.mopd.trainer.forgetting` measures the rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from claas_verl.mopd.trainer.audit_trail import jsonable
from claas_verl.utils.files import atomic_write_text

FORGETTING_JSONL = "forgetting.jsonl"
FORGETTING_MD = "forgetting.md"
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
    lines = [json.dumps({k: jsonable(v) if k not in ("domain", "label", "at") else v for k, v in r.items()}) + "\n"
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
