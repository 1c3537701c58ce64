"""CLaaS on verl's OWN vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) with versioned LoRA updates, end to end
on vLLM's CPU build: ``python -m claas_verl.main_claas --config-name claas/reinforce_pp scale=tiny`` with the vLLM
rollout, three updates. Slow (about 4 min on 2 cores): ``.venv-vllm/bin/python -m pytest -q -m "vllm and slow"
tests/claas/test_vllm_versioned_lora_e2e.py``; the same test runs unchanged on a GPU machine with a CUDA build of vLLM.

The LoRA-only weight path is what makes verl's vLLM rollout run on CPU at all: with ``load_format=auto`` verl never
sends the full weights (the sync that fails on vLLM's CPU build, docs/verl-couplings.md V4), only adapters.

From the trainer's trace (the served-policy probe after every update reads ``ClaasVLLMHttpServer.claas_lora_state``):

* every update is served under a NEW adapter id (the initial sync is the first adapter; update u serves adapter
  u + 1), so verl's fixed id is never replaced in place;
* no request ever started on the base model: the producers' requests all ran on versioned adapters;
* replaced adapters are removed from the engine once drained (ids only go up, never the served one), without errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from claas_verl.claas.lora_versions import BASE, LORA_ID_BASE, lora_name

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
UPDATES = 3


def test_claas_on_verls_vllm_rollout_switches_adapters_without_a_base_window(tiny, tmp_path):
    out = tmp_path / "runs"
    env = dict(os.environ, CLAAS_TINY_DIR=str(tiny.root), CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1",
               RAY_ADDRESS="local")
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    cmd = [sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/reinforce_pp", "scale=tiny",
           "actor_rollout_ref.rollout.name=vllm",
           "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras=4", f"claas.max_updates={UPDATES}",
           "claas.eval.enabled=false", "claas.trace_served_weights=true"]
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1500).returncode
    assert rc == 0, log.read_text()[-5000:]
    trace = [json.loads(line) for line in (out / "claas_tiny_reinforce_pp" / "claas_trace.jsonl").open()]
    updates = [r for r in trace if r["event"] == "update"]
    assert [r["update"] for r in updates] == list(range(1, UPDATES + 1))
    removed_before: list[int] = []
    for r in updates:
        state = r["served_lora_0"]
        served = LORA_ID_BASE + 1 + r["update"]  # the initial sync is adapter 1; update u adds adapter u + 1
        assert (state["served_lora_id"], state["served"], state["switches"]) == (served, lora_name(served),
                                                                                r["update"] + 1), state
        assert served in state["loaded"] and all(LORA_ID_BASE < i <= served for i in state["loaded"]), state
        assert BASE not in state["started"], f"requests ran on the base model: {state['started']}"
        assert state["removed"][: len(removed_before)] == removed_before and served not in state["removed"]
        assert state["removed"] == sorted(state["removed"]) and not state["remove_errors"], state
        assert not set(state["removed"]) & set(state["loaded"])
        removed_before = state["removed"]
    last = updates[-1]["served_lora_0"]
    assert sum(last["started"].values()) > 0  # the producers' requests ran through the versioned engine
    assert last["removed"], "no replaced adapter was ever removed"
