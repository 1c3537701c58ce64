"""End to end on CPU: the per-step log and the replay arms of benchmarks/plans/mopd_replay.md in the verl trainer.

One ``python -m claas_verl.main_mopd --config-name mopd/replay_kl scale=tiny`` run (order math -> code -> logic, m = 2,
so stage 3 replays two domains) with every arm key set away from the paper: ``mopd.probe.enabled``,
``mopd.replay.cycle=reversed``, ``mopd.train.replay_weight=0.5``, ``mopd.train.replay_optimizer=separate`` and
``mopd.train.replay_responses_per_prompt=8`` (the recipe's n is 4). Then ``steps.jsonl`` is the reversed plan;
every step carries the probe's KL to M_{k-1} for each domain learned by its stage's end and the update norm; replay
steps sample 8 replies per prompt (new steps 4) and step with their own AdamW state, so the stage's state counts
its new-domain steps only.
"""

from __future__ import annotations

import math

import pytest
from conftest import read_jsonl

pytestmark = pytest.mark.slow  # one verl job, about 3-5 minutes on 2 cores (run with -m slow)

OVERRIDES = ("mopd.order=[math,code,logic]", "mopd.replay.m=2", "mopd.replay.cycle=reversed",
             "mopd.probe.enabled=true", "mopd.probe.prompts=2", "mopd.train.replay_weight=0.5",
             "mopd.train.replay_optimizer=separate", "mopd.train.replay_responses_per_prompt=8")


def test_the_step_log_and_the_replay_arms_run_in_the_trainer(mopd_run, mopd_plan, fast):
    run_dir, log = mopd_run("mopd/replay_kl scale=tiny", "arms", *fast, *OVERRIDES)
    plan = mopd_plan("mopd/replay_kl scale=tiny", *OVERRIDES)
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [{k: s[k] for k in ("stage", "kind", "domain", "block", "teacher")} for s in steps] == plan
    # stage 3 learns logic (4 blocks), R = 2: forward would replay math then code; reversed replays code then math
    assert [s["domain"] for s in steps if s["stage"] == 3 and s["kind"] == "replay"] == ["code", "math"]
    learned = {1: {"math"}, 2: {"math", "code"}, 3: {"math", "code", "logic"}}
    for s in steps:
        m = s["metrics"]
        probes = {k.removeprefix("mopd/probe_kl/") for k in m if k.startswith("mopd/probe_kl/")}
        assert probes == learned[s["stage"]], (s["global_step"], sorted(m))
        assert all(m[f"mopd/probe_kl/{d}"] >= 0 and math.isfinite(m[f"mopd/probe_kl/{d}"]) for d in probes)
        assert m["mopd/update_norm"] > 0
        replay = s["kind"] == "replay"
        assert m["mopd/responses_per_prompt"] == (8 if replay else 4)
        assert m["mopd/replay_weight"] == (0.5 if replay else 1.0)
        assert m["mopd/optimizer_state"] == int(replay)
    # verl sampled them: a replay step's batch holds twice the rows of a new step (rows × κ = rewards / mean length)
    rows = {s["kind"]: s["metrics"]["mopd/reward_count"] / s["metrics"]["response_length/mean"] for s in steps}
    assert rows["replay"] == pytest.approx(2 * rows["new"], rel=1e-6)
    # the stage's AdamW state counts its new-domain steps only: replay steps step their own state
    for stage in (1, 2, 3):
        counts = [s["metrics"]["mopd/optimizer_steps_in_stage"] for s in steps if s["stage"] == stage]
        kinds = [s["kind"] for s in steps if s["stage"] == stage]
        expect, n = [], 0
        for kind in kinds:
            n += kind == "new"
            expect.append(n)
        assert counts == expect, (stage, kinds, counts)
    # the probe moves within a stage: the first domain drifts from M_{k-1} over stage 2
    drift = [s["metrics"]["mopd/probe_kl/math"] for s in steps if s["stage"] == 2]
    assert drift[-1] > 0
    assert "stage 3 probe: 2 prompts x 2 replies from student:2" in log
