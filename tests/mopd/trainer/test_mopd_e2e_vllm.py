"""The tiny MOPD recipes on verl's own vLLM rollout on CPU: ``actor_rollout_ref.rollout.name=vllm`` is the only
added override (the CPU preset turns vLLM's sleep mode off). Every step samples from vLLM and syncs the full student
weights into it afterwards (docs/verl-couplings.md, V4); after every sync the job scores a fixed probe on
vLLM and in the trainer (``mopd.weight_sync_probe_tokens``), and the test reads both metrics at every step.
Slow (one verl job per recipe, about 17 min each on 2 busy cores):
``.venv-vllm/bin/python -m pytest -q -m "vllm and slow" tests/mopd/trainer/test_mopd_e2e_vllm.py``.
"""

from __future__ import annotations

import json
import re

import pytest

from claas_verl.verl_ext.weight_probe import CHANGE_KEY, DIFF_KEY

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# one token's log-prob, vLLM's float32 CPU kernels vs an HF forward (as tests/claas/service/test_service_vllm.py)
TOL_TOKEN = 1e-4
PLAN_KEYS = ("stage", "kind", "domain", "block", "teacher")


@pytest.mark.parametrize("recipe", ["mopd/seq scale=tiny", "mopd/fsar_shared scale=tiny mopd.signal.window=16"])
def test_tiny_recipe_runs_on_verls_vllm_rollout(recipe, mopd_run, mopd_plan):
    run_dir, log = mopd_run(recipe, recipe.split()[0].split("/")[1], "actor_rollout_ref.rollout.name=vllm",
                            timeout=1800)
    assert "weight_loader" not in log
    steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines() if x.strip()]
    assert [{k: s[k] for k in PLAN_KEYS} for s in steps] == mopd_plan(recipe)
    assert all(s["metrics"]["mopd/update_skipped"] == 0 for s in steps)  # every step made its AdamW update
    # ... and synced the new weights into vLLM (verl's console logger: one line per step)
    synced = {int(n) for n, _ in re.findall(r"step:(\d+) - .*?timing_s/update_weights:([0-9.e-]+)", log)}
    assert synced == {s["global_step"] for s in steps}, synced
    # ... and vLLM then served exactly them: the fixed probe's served log-probs equal the trainer's forward of the
    # updated student (vLLM's float32 CPU kernels vs one HF forward: rounding only), and moved since the last sync
    diffs = [s["metrics"][DIFF_KEY] for s in steps]
    changes = [s["metrics"][CHANGE_KEY] for s in steps]
    print(f"{recipe}: weight-sync probe max |served - trained| {max(diffs):.2e}, served change per step "
          f"min {min(changes):.2e} max {max(changes):.2e}")
    assert all(d < TOL_TOKEN for d in diffs), diffs
    assert all(c > 10 * TOL_TOKEN for c in changes), changes
    if recipe.split()[0].endswith("fsar_shared"):  # replay steps ran the balanced update on vLLM's samples
        replay = [s for s in steps if s["kind"] == "replay"]
        assert replay and all(s["metrics"]["actor/mopd/balance_fallback"] == 0 for s in replay)
