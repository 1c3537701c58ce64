"""End to end: ``claas/sdpo scale=tiny`` on CPU through Ray (3 updates of the rule-following stream).

In the default suite: about 75 s on the 2-core host when it is quiet (several minutes when other Ray jobs share
it). The loss arithmetic it drives is checked in ``test_claas_sdpo_worker_loss.py`` (the packed top-K loss equals
``sdpo_loss`` over the full vocabulary). Checked from the run's own records:

- every update's loss is finite, and at least one update had a self-distillation signal (loss > 0);
- after every APPLIED optimizer step the EMA teacher moved toward the student by exactly τ
  (Σθ_T' = (1−τ)·Σθ_T + τ·Σθ over the LoRA tensors, read back from the worker), and it did not move after a
  skipped step (no feedback in the minibatch, docs/math.md §A.2.4);
- every push after the first sync carried only LoRA adapter tensors, and the served policy changed after every
  applied update.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
UPDATES = 3


def test_tiny_sdpo_end_to_end(tmp_path):
    from claas_verl.tiny import ensure_tiny

    tiny = Path(ensure_tiny().root)
    out = tmp_path / "runs"
    env = dict(os.environ, CLAAS_TINY_DIR=str(tiny), CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1")
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    cmd = [sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/sdpo", "scale=tiny",
           f"claas.max_updates={UPDATES}", "claas.trace_served_weights=true"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]

    losses = [float(x) for x in re.findall(r"actor/sdpo/loss:([-+0-9.eEnaif]+)", log)]
    assert len(losses) == UPDATES and all(math.isfinite(v) for v in losses), losses
    assert any(v > 0 for v in losses), "no minibatch carried verifier feedback: nothing was distilled"

    trace = [json.loads(line) for line in (out / "claas_tiny_sdpo" / "claas_trace.jsonl").read_text().splitlines()]
    updates = [r for r in trace if r["event"] == "update"]
    assert len(updates) == UPDATES
    prev_ema, prev_print = 0, None
    for u in updates:
        probe = u["sdpo"]
        assert probe["ema_updates"] == probe["steps_applied"]
        assert probe["steps_applied"] + probe["steps_skipped"] == u["update"]
        applied = probe["ema_updates"] == prev_ema + 1
        if applied:
            tau = probe["tau"]
            expect = (1 - tau) * probe["teacher_sum_before"] + tau * probe["student_sum"]
            assert abs(probe["teacher_sum_after"] - expect) <= 1e-6 * max(1.0, abs(expect)), probe
            assert probe["teacher_sum_after"] != probe["teacher_sum_before"]
            assert u["served_fingerprint_0"] != prev_print, "the served policy did not change after an update"
        else:
            assert probe["ema_updates"] == prev_ema  # a skipped step leaves the teacher alone
        prev_ema, prev_print = probe["ema_updates"], u["served_fingerprint_0"]
        assert u["served_last_push_kind_0"] == "lora"
        assert all(".lora_A." in n or ".lora_B." in n for n in u["served_last_push_names_0"])
    assert prev_ema >= 1, "no optimizer step was applied"
