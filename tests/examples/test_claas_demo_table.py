"""examples/run_claas_demo.py's closing table: the committed five-method comparison, as the benchmark computed it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import run_claas_demo as demo  # noqa: E402


def test_the_table_has_every_method_with_the_committed_figures():
    lines = demo.committed_comparison()
    results = json.loads((demo.COMMITTED / "results.json").read_text())
    assert lines[0].startswith("committed comparison, compatible rule stream, seeds 3-7")
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert set(rows) == {"REINFORCE++", "PPO", "SDPO", "ICL", "no"}
    final, hw = results["claas_paired"]["differences"]["claas/tiny_reinforce_pp"]["final_avg"]
    assert f"{final:+.3f} ± {hw:.3f}" in rows["REINFORCE++"] and "+0.260 ± 0.228" in rows["REINFORCE++"]  # README's
    assert rows["no"].rstrip().endswith("baseline")


def test_a_one_seed_result_prints_without_an_interval(tmp_path):
    base, arm = "claas/tiny_no_update", "claas/tiny_sdpo"
    (tmp_path / "results.json").write_text(json.dumps({
        "summary": {arm: {"seeds": [3], "final_avg": [0.2, None], "forgetting": [0.1, None]},
                    base: {"seeds": [3], "final_avg": [0.3, None], "forgetting": [0.0, None]}},
        "claas_paired": {"baseline": base, "differences": {arm: {"final_avg": [-0.1, None]}}}}))
    lines = demo.committed_comparison(tmp_path)
    assert lines[0].startswith("committed comparison, compatible rule stream, seeds 3-3")
    assert lines[2].split() == ["SDPO", "0.200", "0.100", "-0.100"]
