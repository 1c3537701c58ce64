"""The reward function of the MOPD prompt files, on rows built by ``python -m claas_verl.mopd.data mopd``."""

from __future__ import annotations

import json

import pytest

from claas_verl.mopd.data.mopd import logic_candidates, to_rows
from claas_verl.mopd.data.rewards import compute_score


def test_logic_rows_are_scored_by_reasoning_gym_from_their_meta():
    (row,) = to_rows("logic", list(logic_candidates(1, seed=0, tasks=("basic_arithmetic",))), 32)
    truth, info = row["reward_model"]["ground_truth"], row["extra_info"]
    ds = row["data_source"]
    assert compute_score(ds, f"<think>maybe 0</think>so <answer>{truth}</answer>", truth, info) == 1.0
    assert compute_score(ds, f"<answer>{truth}</answer></think>no tag after thinking", truth, info) == 0.0
    assert compute_score(ds, "truncated", truth, info) == 0.0
    with pytest.raises(ValueError, match="extra_info.meta"):
        compute_score(ds, "<answer>1</answer>", truth, {})


def test_math_code_safety_if_and_tiny_sources():
    assert compute_score("math_dapo", "work\nAnswer: 42", "42") == 1.0
    assert compute_score("math_dapo", "Answer: 41", "42") == -1.0  # verl's DAPO scorer
    assert compute_score("nvidia/OpenCodeReasoning", "</think>```python\nprint(1)\n```", "") == 1.0
    assert compute_score("nvidia/OpenCodeReasoning", "```python\nprint(1)\n```</think>prose only", "") == 0.0
    assert compute_score("star1/refuse", "</think>Sorry, I can't help with that.", "refuse") == 1.0
    assert compute_score("star1/comply", "</think>Sure: knead the dough.", "comply") == 1.0
    truth = json.dumps({"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]})
    assert compute_score("ultradata/if", "<think>Hmm</think>all lowercase here", truth) == 1.0
    assert compute_score("ultradata/if", "Not Lowercase", truth) == 0.0
    assert compute_score("ultradata/if", "anything", "") == 0.0
    assert compute_score("claas_tiny/math", r"\boxed{7}", "7") == 1.0
    with pytest.raises(ValueError, match="no reward here"):
        compute_score("somewhere/else", "x", "y")
