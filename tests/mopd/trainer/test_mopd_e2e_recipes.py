"""The other tiny MOPD recipes end to end through ``python -m claas_verl.main_mopd`` (slow: one verl job each).

* Replay-KL vs Seq with the same seeds: stage 1 is identical, and replay steps are taught by the frozen
  previous-stage student (the paper's effect size is not reproducible on the tiny models; see the test).
* Seq + Recovery (S2): a 4th stage from M_3 whose teachers are the stage snapshots M_1..M_3.
* Joint MOPD (S2): one stage holding every expert.
* Fixed share: stage 3 replays both earlier domains.
In every case ``steps.jsonl`` equals the plan.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow
PLAN_KEYS = ("stage", "kind", "domain", "block", "teacher")


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _as_plan(steps):
    return [{k: s[k] for k in PLAN_KEYS} for s in steps]


def test_replay_kl_against_seq_with_the_same_seeds(mopd_run, mopd_plan, fast):
    """Replay-KL vs Seq: same seeds, same stage 1, replay steps taught by the frozen previous-stage student.

    What is NOT asserted: that Replay-KL ends with a lower KL to the logic expert than Seq (the paper's effect).
    On the tiny models the later stages barely move the student on logic prompts (full-vocabulary KL(M_3 || M_1)
    there is about 0.005 nats against about 0.9 to the expert), so there is no forgetting for replay to prevent
    and the comparison is a tie within the evaluation's noise (measured: 0.949 vs 0.941 on 32 prompts x 4
    samples). The comparison is printed for the record.
    """
    common = (*fast, "mopd.eval.prompts=8")
    seq_dir, _ = mopd_run("mopd/seq scale=tiny", "seq", *common)
    rkl_dir, log = mopd_run("mopd/replay_kl scale=tiny", "rkl", *common)
    steps = read_jsonl(rkl_dir / "steps.jsonl")
    seq_steps = read_jsonl(seq_dir / "steps.jsonl")
    assert _as_plan(steps) == mopd_plan("mopd/replay_kl scale=tiny")
    # 1. same seeds: stage 1 (identical plans) is the same computation in both runs, equal up to the order of
    #    float reductions across the two worker processes (observed differences ~1e-7 relative)
    for a, b in zip(seq_steps[:4], steps[:4]):
        for key in ("mopd/kl_topk", "mopd/adv_sigma", "actor/grad_norm"):
            assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5), key
    # 2. replay steps are taught by the FROZEN previous-stage student M_{k-1}: the student has hardly moved on the
    #    replayed domain's prompts since M_{k-1}, so its KL to that teacher is tiny, far below the KL of any
    #    new-domain step to its expert (a wrong teacher, e.g. the logic expert, would give about 0.7)
    replay = [s for s in steps if s["kind"] == "replay"]
    assert [(s["stage"], s["domain"], s["teacher"]) for s in replay] == [
        (2, "logic", "student:1"), (3, "logic", "student:2")]
    assert "teachers ['expert:math', 'student:1']" in log and "teachers ['expert:code', 'student:2']" in log
    new_kl = min(s["metrics"]["mopd/kl_binned"] for s in steps if s["kind"] == "new")
    for s in replay:
        assert 0 <= s["metrics"]["mopd/kl_binned"] < 0.05 < new_kl, (s["metrics"], new_kl)
    final = {}
    for name, d in (("seq", seq_dir), ("rkl", rkl_dir)):
        rows = read_jsonl(d / "forgetting.jsonl")
        final[name] = {r["domain"]: (round(r["kl"], 4), round(r["kl_binned"], 4))
                       for r in rows if r["stage"] == 3 and r["at"] == "end"}
        assert set(final[name]) == {"logic", "math", "code"}
    print(f"final students, (kl, kl_binned) to each expert: {final}")


@pytest.mark.parametrize("recipe", ["mopd/seq_recovery scale=tiny mopd.recovery.blocks_per_domain=2",
                                    "mopd/joint scale=tiny",
                                    "mopd/replay_kl_fixed scale=tiny mopd.replay.b=2"])
def test_recipe_runs_its_plan(recipe, mopd_run, mopd_plan, fast):
    run_dir, log = mopd_run(recipe, recipe.split()[0].split("/")[1], *fast, "mopd.eval.enabled=false")
    steps = read_jsonl(run_dir / "steps.jsonl")
    plan = mopd_plan(recipe)
    assert _as_plan(steps) == plan
    stages = sorted({s["stage"] for s in plan})
    assert log.count("fresh AdamW state") == len(stages)
    if recipe.split()[0].endswith("recovery"):
        assert "teachers ['student:1', 'student:2', 'student:3']" in log  # recovery from the snapshots
    if recipe.split()[0].endswith("joint"):
        assert "teachers ['expert:code', 'expert:logic', 'expert:math']" in log
