"""Tiny data sets: verl RL schema, held-out test split, determinism, rewards (ours and verl's gsm8k)."""

import json

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from claas_verl.tiny import ALL_DATA_DOMAINS, MOPD_DOMAINS, ensure_tiny
from claas_verl.tiny.data import make_split
from claas_verl.tiny.rewards import compute_score, strip_thinking

torch.set_num_threads(1)  # shared 2-core machine: avoid intra-op thread thrash during the bundle build


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny()


@pytest.fixture(scope="module")
def frames(tiny):
    return {(d, s): pd.read_parquet(getattr(tiny, s)[d]) for d in ALL_DATA_DOMAINS for s in ("train", "test")}


def test_schema_is_verl_rl_format(frames):
    for (domain, split), df in frames.items():
        assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        assert len(df) >= (64 if split == "train" else 16)
        expected_source = "openai/gsm8k" if domain == "arith" else f"claas_tiny/{domain}"
        assert set(df.data_source) == {expected_source}
        for row in df.itertuples():
            roles = [m["role"] for m in row.prompt]
            assert roles == ["system", "user"] and all(isinstance(m["content"], str) for m in row.prompt)
            assert row.reward_model["style"] == "rule" and isinstance(row.reward_model["ground_truth"], str)
            assert row.extra_info["split"] == split and row.extra_info["domain"] == domain
        assert list(df.extra_info.map(lambda e: e["index"])) == list(range(len(df)))


def test_test_split_is_held_out_and_distinct(frames):
    for domain in ALL_DATA_DOMAINS:
        train = {p[1]["content"] for p in frames[(domain, "train")].prompt}
        test = [p[1]["content"] for p in frames[(domain, "test")].prompt]
        assert len(set(test)) == len(test)
        assert not train & set(test), domain


def test_prompts_fit_a_256_token_budget(tiny, frames):
    tok = AutoTokenizer.from_pretrained(tiny.student)
    longest = max(
        len(tok.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True))
        for df in frames.values() for p in df.prompt
    )
    assert longest < 256  # characters, so tokens are fewer still: max_prompt_length=256 never filters


def test_rows_are_deterministic_and_seeded():
    a = make_split("logic", 8, 4, seed=0)
    assert a == make_split("logic", 8, 4, seed=0)
    assert a != make_split("logic", 8, 4, seed=1)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="domain='chess'"):
        make_split("chess", 8, 4)
    with pytest.raises(ValueError, match="n_test"):
        make_split("safety", 8, 10_000)  # safety has ~100 distinct prompts


def test_verl_default_reward_scores_arith(frames):
    from verl.utils.reward_score import default_compute_score

    row = frames[("arith", "test")].iloc[0]
    truth = row.reward_model["ground_truth"]
    assert default_compute_score("openai/gsm8k", f"Some steps.\n#### {truth}", truth) == 1.0
    assert default_compute_score("openai/gsm8k", f"#### {int(truth) + 1}", truth) == 0.0
    assert default_compute_score("openai/gsm8k", truth, truth) == 0  # no "####": strict format fails
    assert default_compute_score(row.data_source, row.extra_info["reference"], truth) == 1.0


def test_reference_answers_score_one_everywhere(frames):
    for df in frames.values():
        for row in df.itertuples():
            gt = row.reward_model["ground_truth"]
            assert compute_score(row.data_source, row.extra_info["reference"], gt, dict(row.extra_info)) == 1.0
            # a thinking block in front changes nothing
            assert compute_score(row.data_source, "<think>\nhm\n</think>\n\n" + row.extra_info["reference"], gt) == 1.0


@pytest.mark.parametrize("source,response,truth,score", [
    ("claas_tiny/logic", "Answer: Alice", "Alice", 1.0),
    ("claas_tiny/logic", "Answer: Bob", "Alice", 0.0),
    ("claas_tiny/logic", "Alice", "Alice", 0.0),  # no "Answer:" line
    ("claas_tiny/math", "so \\boxed{-3}", "-3", 1.0),
    ("claas_tiny/math", "\\boxed{4} then \\boxed{5}", "4", 0.0),  # the last box counts
    ("claas_tiny/code", "```\nnekot\n```", "nekot", 1.0),
    ("claas_tiny/code", "nekot", "nekot", 0.0),
    ("claas_tiny/safety", "I'm sorry, I can't.", "refuse", 1.0),
    ("claas_tiny/safety", "Sure, here you go.", "refuse", 0.0),
    ("claas_tiny/safety", "Sure, here you go.", "comply", 1.0),
    ("claas_tiny/safety", "", "comply", 0.0),
    ("claas_tiny/if", "all lower case", json.dumps({"type": "lowercase"}), 1.0),
    ("claas_tiny/if", "Not lower", json.dumps({"type": "lowercase"}), 0.0),
    ("claas_tiny/if", "one two three", json.dumps({"type": "max_words", "n": 2}), 0.0),
    ("claas_tiny/if", "a golden sky", json.dumps({"type": "include", "word": "golden"}), 1.0),
    ("claas_tiny/if", "goldenrod", json.dumps({"type": "include", "word": "golden"}), 0.0),
    ("claas_tiny/if", "Bye. Done.", json.dumps({"type": "ends_with", "text": "Done."}), 1.0),
    ("claas_tiny/math", "<think>\\boxed{7}</think>\\boxed{8}", "8", 1.0),  # thinking is not graded
    ("claas_tiny/math", "\\boxed{8}<think>\\boxed{7}", "7", 0.0),  # truncated thinking is dropped
    ("openai/gsm8k", "4 + 4 = 8\n#### 8", "8", 1.0),
])
def test_reward_cases(source, response, truth, score):
    assert compute_score(source, response, truth) == score


def test_strip_thinking():
    assert strip_thinking("<think>a</think>b<think>c</think> d ") == "b d"
    assert strip_thinking("x<think>never closed") == "x"


def test_unknown_source_is_a_clear_error():
    with pytest.raises(ValueError, match="data_source='nope'"):
        compute_score("nope", "x", "y")


def test_verl_loads_the_reward_file_by_path(tiny):
    # What custom_reward_function.path / name does in a recipe; verl may add keyword arguments.
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path=str(tiny.rewards), object_name="compute_score")
    assert fn(data_source="claas_tiny/math", solution_str="\\boxed{3}", ground_truth="3", extra_info={},
              reward_router_address=None) == 1.0


def test_every_mopd_domain_has_a_reward():
    for domain in MOPD_DOMAINS:
        train, _ = make_split(domain, 2, 1)
        row = train[0]
        assert compute_score(row["data_source"], row["extra_info"]["reference"],
                             row["reward_model"]["ground_truth"]) == 1.0
