"""The forgetting table of a MOPD run (claas_verl.mopd.trainer.forgetting_table): pure python, hand-checked cases."""

from __future__ import annotations

import pytest

from claas_verl.mopd.trainer.forgetting_table import (
    append_forgetting,
    forgetting_table,
    read_forgetting,
    stage_end_measured,
    stage_end_rows,
)


def test_forgetting_table_layout(tmp_path):
    rows = [
        {"stage": 1, "at": "start", "domain": "logic", "kl": 0.75, "kl_binned": 1.5, "score": None},
        {"stage": 1, "at": "end", "domain": "logic", "kl": 0.25, "kl_binned": 0.5, "score": 0.5},
        {"stage": 2, "at": "end", "domain": "logic", "kl": 0.375, "score": None},
        {"stage": 2, "at": "end", "domain": "math", "kl": 0.125, "score": 1.0},
    ]
    append_forgetting(str(tmp_path), rows)
    table = forgetting_table(read_forgetting(str(tmp_path)), title="seq")
    lines = table.splitlines()
    assert lines[0] == "### seq"
    assert lines[1] == "| after stage | KL to E[logic] (score) | KL to E[math] (score) |"
    assert lines[3] == "| 1 | 0.2500 (0.50) |  |"
    assert lines[4] == "| 2 | 0.3750 | 0.1250 (1.00) |"
    assert lines[6] == ("| stage | taught domain | KL to its expert at stage start | at stage end | change "
                        "| (k+1)-bin KL start → end |")
    assert lines[8] == "| 1 | logic | 0.7500 | 0.2500 (0.50) | -0.5000 | 1.5000 → 0.5000 |"
    assert len(lines) == 9
    assert forgetting_table([]) == "(no stage has ended yet)"
    assert forgetting_table(rows[:1]) == "(no stage has ended yet)"


def test_forgetting_rows_are_replaced_not_duplicated_when_a_resumed_run_measures_again(tmp_path):
    append_forgetting(str(tmp_path), [{"stage": 1, "at": "end", "domain": "logic", "kl": 0.5, "score": None},
                                      {"stage": 2, "at": "start", "domain": "math", "kl": 0.9, "score": None}])
    append_forgetting(str(tmp_path), [{"stage": 2, "at": "start", "domain": "math", "kl": 0.8, "score": None}])
    rows = read_forgetting(str(tmp_path))
    assert [(r["stage"], r["at"], r["domain"], r["kl"]) for r in rows] == [
        (1, "end", "logic", 0.5), (2, "start", "math", 0.8)]
    assert stage_end_rows(rows) == rows[:1]
    with pytest.raises(ValueError, match="'at' must be one of"):
        append_forgetting(str(tmp_path), [{"stage": 3, "at": "middle", "domain": "code", "kl": 0.1}])
    assert len(read_forgetting(str(tmp_path))) == 2  # a rejected row changes nothing


def test_a_lost_stage_end_evaluation_is_found():
    rows = [{"stage": 1, "at": "end", "domain": "logic"}, {"stage": 2, "at": "start", "domain": "math"}]
    assert stage_end_measured(rows, 1) and not stage_end_measured(rows, 2)
