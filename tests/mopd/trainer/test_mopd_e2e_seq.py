"""End to end on CPU: ``python -m claas_verl.main_mopd --config-name mopd/seq scale=tiny`` (verl + Ray, 10 steps, 3
stages).

One short run (shorter responses and fewer held-out prompts than the recipe; the plan is the recipe's), then:
``steps.jsonl`` equals the plan step by step (stage, kind, domain, block, teacher), every stage starts with a
fresh AdamW state (the optimizer's step count is 1 after each stage's first update and grows inside the stage),
the stage-final students M_1..M_3 exist in Hugging Face format and differ from π_0 and from each other, every
checkpoint has its ``mopd_state.json``, the forgetting table has one row per stage end and learned domain,
during every stage the held-out KL from the student to the new domain's expert falls, after every weight sync the
rollout's log-probs of a fixed probe equal the trainer's forward of the updated student and moved, and the step
metrics reach wandb (offline) and tensorboard (``trainer.logger=[console,wandb,tensorboard]``).
"""

from __future__ import annotations

import json
import math
import re

import torch

from claas_verl.verl_ext.weight_probe import CHANGE_KEY, DIFF_KEY


def test_tiny_seq_runs_the_plan_end_to_end(tiny_dir, mopd_run, mopd_plan, fast, tracking_logs):
    # 8 held-out prompts per domain (FAST has 2), 4 sampled responses each, so that the start/end KL of a stage
    # is not sampling noise
    run_dir, log = mopd_run("mopd/seq scale=tiny", "seq", *fast, "mopd.eval.prompts=8", *tracking_logs.overrides)
    plan = mopd_plan("mopd/seq scale=tiny")
    steps = read_jsonl(run_dir / "steps.jsonl")
    # 1. the audit trail is the plan, step by step (4 logic + 3 math + 3 code new-domain steps)
    assert [{k: s[k] for k in ("stage", "kind", "domain", "block", "teacher")} for s in steps] == plan
    assert [s["global_step"] for s in steps] == list(range(1, 11))
    for s in steps:
        m = s["metrics"]
        assert math.isfinite(m["mopd/kl_topk"])
        assert m["mopd/adv_sigma"] > 0 and math.isfinite(m["actor/loss"]) and m["actor/grad_norm"] > 0
        # verl's per-phase timings and throughput stay in the audit trail
        phases = ("gen", "old_log_prob", "adv", "update_actor", "update_weights", "step")
        assert all(m[f"timing_s/{p}"] >= 0 for p in phases) and m["perf/throughput"] > 0, sorted(m)
    # the weight-sync probe after every update: the rollout serves exactly the updated student (HF rollout vs the
    # FSDP trainer's forward, both float32) and no longer the previous step's weights
    assert all(s["metrics"][DIFF_KEY] < 1e-4 for s in steps), [s["metrics"][DIFF_KEY] for s in steps]
    assert all(s["metrics"][CHANGE_KEY] > 1e-3 for s in steps), [s["metrics"][CHANGE_KEY] for s in steps]
    # 2. fresh AdamW state per stage: step count 1 after the first update of a stage, then +1 per step
    counts = [s["metrics"]["mopd/optimizer_steps_in_stage"] for s in steps]
    assert counts == [1, 2, 3, 4, 1, 2, 3, 1, 2, 3]
    assert log.count("fresh AdamW state") == 3
    # a console line per step with the stage's position and ETA
    assert re.search(r"\[mopd\] step 2/10 stage 1/3: 2/4 steps \(50%\), \d+:\d\d elapsed, ETA \d+:\d\d \| "
                     r"new logic block 1 teacher expert:logic, kl_topk ", log), log[-3000:]
    assert "[mopd] step 10/10 stage 3/3: 3/3 steps (100%)" in log and log.count("[mopd] step ") == 10
    # 3. stage snapshots M_1..M_3 in HF format; each stage moved the weights
    from transformers import AutoModelForCausalLM

    def load(p):
        return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).state_dict()

    states = [load(tiny_dir / "student")] + [load(run_dir / "snapshots" / f"student_{j}") for j in (1, 2, 3)]
    key = "model.layers.0.mlp.up_proj.weight"
    for a, b in zip(states, states[1:]):
        assert not torch.equal(a[key], b[key])
    # 4. resume state beside every checkpoint (saved at each stage end: global steps 4, 7, 10)
    for gs, stage in ((4, 1), (7, 2), (10, 3)):
        state = json.loads((run_dir / f"global_step_{gs}" / "mopd_state.json").read_text())
        assert state["stage"] == stage and state["stage_complete"] and state["snapshots"] == list(range(1, stage + 1))
    # 5. forgetting table: after stage k, one row per learned domain
    rows = read_jsonl(run_dir / "forgetting.jsonl")
    ends = [r for r in rows if r["at"] == "end"]
    assert [(r["stage"], r["domain"]) for r in ends] == [
        (1, "logic"), (2, "logic"), (2, "math"), (3, "logic"), (3, "math"), (3, "code")]
    assert all(math.isfinite(r["kl"]) for r in rows)  # top-k restricted: may be < 0 (q not renormalised)
    assert all(r["kl_binned"] >= 0 for r in rows)  # the (k+1)-bin KL is a KL: never negative
    table = (run_dir / "forgetting.md").read_text()
    assert "| after stage |" in table and "| stage | taught domain |" in table
    # 6. each stage learns its domain: KL(student || E_k) on E_k's held-out prompts (8 prompts x 4 sampled
    #    responses) falls from the stage's start (measured before its first update) to its end, both as the MOPD paper
    # logs
    #    it and as the (k+1)-bin lower bound of the full-vocabulary KL
    starts = {r["stage"]: r for r in rows if r["at"] == "start"}
    assert [(s, r["domain"], r["global_step"]) for s, r in sorted(starts.items())] == [
        (1, "logic", 0), (2, "math", 4), (3, "code", 7)]
    for r in ends:
        if r["stage"] in starts and r["domain"] == starts[r["stage"]]["domain"]:
            assert r["kl"] < starts[r["stage"]]["kl"], (starts[r["stage"]], r)
            assert r["kl_binned"] < starts[r["stage"]]["kl_binned"], (starts[r["stage"]], r)
    # 7. with trainer.logger=[console,wandb,tensorboard], the step metrics reach wandb (offline) and tensorboard
    logged = {"mopd/kl_topk", "mopd/adv_sigma", "mopd/optimizer_steps_in_stage", "actor/loss"}
    for keys in (tracking_logs.wandb_keys(), tracking_logs.tensorboard_keys()):
        assert logged <= keys, sorted(keys)

def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
