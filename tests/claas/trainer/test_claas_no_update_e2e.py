"""The no-update baseline (``claas/no_update scale=tiny``) end to end: the same producers and split evaluation as the
training recipes, and provably no policy change: no update, nothing inserted into the buffer, no checkpoint, the
served policy still version 0. Slow (one Ray job, about a minute on an idle 2-core host)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_no_update_baseline_evaluates_every_split_without_changing_the_policy(tiny, tmp_path):
    out = tmp_path / "runs"
    env = dict(os.environ, CLAAS_TINY_DIR=str(tiny.root), CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1")
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    cmd = [sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/no_update", "scale=tiny"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    run_dir = out / "claas_tiny_no_update"
    metrics = json.loads((run_dir / "continual_metrics.json").read_text())
    assert metrics["algorithm"] == "no_update" and metrics["updates"] == 0
    K = metrics["K"]
    assert K == 2 and all(len(row) == K and all(0.0 <= v <= 1.0 for v in row) for row in metrics["M"])
    for key in ("forward_transfer", "forgetting", "final"):
        assert math.isfinite(metrics[key])
    # the producers ran every split's scenarios and graded their steps, but inserted nothing
    producer = metrics["producer"]
    assert producer["scenarios"] == 2 * 3 and producer["steps"] > 0
    assert producer["entries_sent"] == producer["entries_accepted"] == 0
    assert metrics["buffer_stats"]["size"] == 0 and metrics["buffer_stats"]["update_count"] == 0
    # no optimizer step, no checkpoint, no weight push: every split is evaluated on the initial policy
    trace = [json.loads(line) for line in (run_dir / "claas_trace.jsonl").read_text().splitlines()]
    assert not [e for e in trace if e["event"] == "update"]
    assert [e["split"] for e in trace if e["event"] == "split_end"] == [1, 2]
    assert all(e["global_steps"] == trace[-1]["global_steps"] for e in trace if "global_steps" in e)
    assert [s["checkpoint"] for s in metrics["splits"]] == [None, None]
    assert not list(run_dir.glob("global_step_*"))
