"""End to end: verl's own main_ppo runs GRPO for 2 steps on CPU through Ray with the CPU preset.

Runs ``python -m verl.trainer.main_ppo --config-path recipes/ppo --config-name tiny_grpo +cpu=default``
in a subprocess (as a user would), then checks: the run exited 0, per-step metrics were
printed with a finite loss, the HF checkpoint of step 2 loads with transformers, and its
parameters differ from the initial model's. Wall time is dominated by Ray/verl start-up.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


def _metric(line: str, key: str) -> float:
    m = re.search(rf"{re.escape(key)}:(-?[0-9.eE+-]+|nan|inf)", line)
    assert m, f"metric {key} missing from: {line[:200]}"
    return float(m.group(1))


def test_main_ppo_grpo_two_steps_on_cpu(tiny_model_dir, tmp_path):
    env = dict(os.environ, CLAAS_TINY_DIR=str(tiny_model_dir), CLAAS_OUT_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo",
        f"--config-path={REPO}/recipes/ppo", "--config-name=tiny_grpo", "+cpu=default",
        "trainer.total_training_steps=2", "trainer.save_freq=2",
    ]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    steps = [line for line in log.splitlines() if re.search(r"step:\d+ - ", line)]
    assert len(steps) == 2, log[-4000:]
    for line in steps:
        assert math.isfinite(_metric(line, "actor/pg_loss"))
        assert _metric(line, "actor/grad_norm") > 0.0  # the shaped reward gives a non-zero advantage
    print(f"e2e wall time {time.time() - start:.1f}s; step times:",
          [_metric(line, "timing_s/step") for line in steps])

    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "tiny_grpo" / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    trained = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(Path(tiny_model_dir) / "student", dtype=torch.float32)
    t_state, i_state = trained.state_dict(), initial.state_dict()
    assert set(t_state) == set(i_state)
    changed = [k for k in i_state if not torch.equal(t_state[k], i_state[k])]
    assert changed, "no parameter changed after 2 GRPO steps"
