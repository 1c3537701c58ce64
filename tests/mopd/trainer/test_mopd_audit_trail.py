"""The audit trail of a MOPD run (claas_verl.mopd.trainer.audit_trail): pure python, hand-checked cases."""

from __future__ import annotations

import json

from claas_verl.mopd.trainer.audit_trail import DISCARDED_FILE, append_step, read_steps, skipped_update, truncate_steps
from claas_verl.mopd.trainer.plan_steps import PLAN_KEYS


def test_steps_jsonl_append_and_truncate_on_resume(tmp_path, small_plan):
    _, steps = small_plan("seq")
    for gs in (1, 2, 3):
        append_step(str(tmp_path), gs, steps[gs - 1], {"mopd/kl_topk": 0.5, "bad": float("nan"), "name": "x"})
    recs = read_steps(str(tmp_path))
    assert [r["global_step"] for r in recs] == [1, 2, 3]
    assert recs[0]["metrics"] == {"bad": None, "mopd/kl_topk": 0.5, "name": "x"}  # NaN is not valid JSON
    assert {k: recs[1][k] for k in PLAN_KEYS} == steps[1]
    assert truncate_steps(str(tmp_path), 1) == 2
    assert [r["global_step"] for r in read_steps(str(tmp_path))] == [1]
    discarded = (tmp_path / DISCARDED_FILE).read_text().splitlines()
    assert [json.loads(x)["global_step"] for x in discarded] == [2, 3]


def test_non_finite_grad_norm_marks_a_skipped_update(tmp_path):
    assert skipped_update({"actor/grad_norm": float("nan")})
    assert skipped_update({"actor/grad_norm": float("inf")})
    assert not skipped_update({"actor/grad_norm": 3.0}) and not skipped_update({})
    rec = append_step(str(tmp_path), 4, {"stage": 1, "kind": "new", "domain": "logic", "block": 3,
                                         "teacher": "expert:logic"},
                      {"actor/grad_norm": float("nan"), "mopd/update_skipped": 1})
    assert rec["metrics"] == {"actor/grad_norm": None, "mopd/update_skipped": 1}
