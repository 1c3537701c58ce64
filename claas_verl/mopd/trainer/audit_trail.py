"""The audit trail of a continual MOPD run: ``<run>/steps.jsonl``, one JSON object per executed step.

Each record holds the plan fields (``stage, kind, domain, block, teacher``, same vocabulary as
``python -m claas_verl.plan plan.format=json``) plus ``global_step`` and the step's metrics. On resume, lines after
the resumed step are moved to ``steps.discarded.jsonl`` (they belong to work that the checkpoint does not contain).
Pure python (no verl, no ray, no torch).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from claas_verl.mopd.trainer.plan_steps import PLAN_KEYS

STEPS_FILE = "steps.jsonl"
DISCARDED_FILE = "steps.discarded.jsonl"


def jsonable(v: Any) -> Any:
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
    rec["metrics"] = {k: jsonable(v) for k, v in sorted(metrics.items())}
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


def skipped_update(metrics: dict[str, Any]) -> bool:
    """verl skips the AdamW step (and zeroes the gradients) when the gradient norm is not finite."""
    g = metrics.get("actor/grad_norm")
    try:
        return g is not None and not math.isfinite(float(g))
    except (TypeError, ValueError):
        return False
