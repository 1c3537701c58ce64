"""The in-process rule probe (benchmarks/claas_rule_probe.py): its scenario pools and one short stream on the tiny
model (each split trains only its own rule, every rule is evaluated after every split)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import claas_rule_probe as rule_probe  # noqa: E402


def test_pools_hold_one_rule_of_the_family_and_prompts_are_system_plus_one_turn():
    pool = rule_probe.rule_pool("end_punctuation", 5)
    assert len(pool) == 5 and all(s.meta["families"] == ["end_punctuation"] for s in pool)
    draws = rule_probe.prompts_of(pool, random.Random(0), 8)
    for sc, turn, msgs in draws:
        assert [m["role"] for m in msgs] == ["system", "user"]
        assert msgs[0]["content"] == sc.system_prompt and msgs[1]["content"] == sc.user_turns[turn]


def test_a_short_stream_trains_and_reports_every_rule(tiny, tmp_path):
    out = rule_probe.run(["capital_start", "end_punctuation"], ["few_words"], updates_per_split=1, batch=2, lr=1e-3,
                         seed=0, eval_samples=4, max_new_tokens=4, model_dir=str(tiny.student))
    assert out["families"] == ["capital_start", "end_punctuation", "few_words"]
    assert len(out["rows"]) == 3 and len(out["rewards"]) == 2  # π0 + one row per split; one update per split
    assert all(set(row) == set(out["families"]) and all(v in (0, 0.25, 0.5, 0.75, 1.0) for v in row.values())
               for row in out["rows"])
    rule_probe.main(["--stream", "capital_start", "--updates-per-split", "1", "--batch", "2", "--eval-samples", "2",
                     "--max-new-tokens", "4", "--model-dir", str(tiny.student), "--out", str(tmp_path / "p.json")])
    assert (tmp_path / "p.json").read_text().startswith("[")
