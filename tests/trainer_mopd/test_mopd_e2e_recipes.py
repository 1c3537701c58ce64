"""The other tiny MOPD recipes end to end through ``python -m claas_verl.main_mopd`` (slow: one verl job each).

* Replay-KL vs Seq with the same seeds: replay steps are taught by the frozen previous-stage student, and the
  final student stays closer to the first domain's expert (the paper's point, on tiny models).
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


def test_replay_kl_forgets_less_than_seq(mopd_run, mopd_plan, fast):
    common = (*fast, "mopd.eval.prompts=8")
    seq_dir, _ = mopd_run("mopd/tiny_seq", "seq", *common)
    rkl_dir, log = mopd_run("mopd/tiny_replay_kl", "rkl", *common)
    steps = read_jsonl(rkl_dir / "steps.jsonl")
    assert _as_plan(steps) == mopd_plan("mopd/tiny_replay_kl")
    replay = [s for s in steps if s["kind"] == "replay"]
    assert [(s["stage"], s["teacher"]) for s in replay] == [(2, "student:1"), (3, "student:2")]
    assert "teachers ['expert:math', 'student:1']" in log
    final = {}
    for name, d in (("seq", seq_dir), ("rkl", rkl_dir)):
        rows = read_jsonl(d / "forgetting.jsonl")
        final[name] = {r["domain"]: r["kl"] for r in rows if r["stage"] == 3 and r["at"] == "end"}
    assert final["rkl"]["logic"] < final["seq"]["logic"], final


@pytest.mark.parametrize("recipe", ["mopd/tiny_seq_recovery", "mopd/tiny_joint", "mopd/tiny_replay_kl_fixed"])
def test_recipe_runs_its_plan(recipe, mopd_run, mopd_plan, fast):
    run_dir, log = mopd_run(recipe, recipe.split("/")[1], *fast, "mopd.eval.enabled=false")
    steps = read_jsonl(run_dir / "steps.jsonl")
    plan = mopd_plan(recipe)
    assert _as_plan(steps) == plan
    stages = sorted({s["stage"] for s in plan})
    assert log.count("fresh AdamW state") == len(stages)
    if recipe.endswith("recovery"):
        assert "teachers ['student:1', 'student:2', 'student:3']" in log  # recovery from the snapshots
    if recipe.endswith("joint"):
        assert "teachers ['expert:code', 'expert:logic', 'expert:math']" in log
