"""``python -m claas_verl.mopd.data mopd`` on hand-made source files shaped like the MOPD paper's datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from claas_verl.mopd.data import mopd as mopd_data
from claas_verl.mopd.data.cli import main

FIX = Path(__file__).resolve().parents[2] / "fixtures"
SRC = FIX / "data"
LOGIC_TASKS = "basic_arithmetic,letter_counting,spell_backward"


def _args(out, tiny, *extra):
    return ["mopd", "--out", str(out), "--tokenizer", str(tiny.student), "--math", str(SRC / "dapo_math.jsonl"),
            "--code", str(SRC / "open_code_reasoning.jsonl"), "--safety-harmful", str(SRC / "star1.jsonl"),
            "--safety-benign", str(SRC / "star_benign.jsonl"), "--if", str(SRC / "ultradata_if.jsonl"),
            "--blocks", "logic=2,math=3,code=2,safety=3,if=3", "--block-size", "4", "--logic-tasks", LOGIC_TASKS,
            "--eval-data-dir", str(FIX / "eval"), "--no-gym-overlap", *extra]


def test_normalize_and_overlap_index():
    assert mopd_data.normalize("  Hello\n\tWORLD  a+b ") == "hello world a+b"
    idx = mopd_data.OverlapIndex(["What is 2 + 2?", "Write a poem.\n\nUse  lowercase."])
    assert idx.hit("what is 2 + 2?")  # identical after normalisation
    assert idx.hit("Please answer: WHAT IS 2 + 2?  Thanks")  # contains an evaluation prompt
    assert idx.hit("use lowercase")  # contained in an evaluation prompt
    assert not idx.hit("What is 2 plus 2?") and not idx.hit("what is 2+2?")  # symbols and spacing inside kept
    assert not idx.hit("   ")


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("mopd_data")
    assert main(_args(out, tiny)) == 0
    return out


def test_files_blocks_and_counts(built):
    man = json.loads((built / "manifest.json").read_text())
    doms = man["domains"]
    assert {d: doms[d]["rows"] for d in doms} == {"logic": 8, "math": 12, "code": 8, "safety": 12, "if": 12}
    # DAPO-Math: one repeated row, one prompt over 2048 tokens, and one containing the AIME24 fixture problem
    assert (doms["math"]["duplicate"], doms["math"]["too_long"], doms["math"]["overlap"]) == (1, 1, 1)
    # UltraData-IF: the row that duplicates an IFEval prompt (MOPD paper removed 4 such)
    assert doms["if"]["overlap"] == 1
    assert man["eval_prompts_checked"] == 23  # the fixture benchmarks (GYM skipped here)
    for d in mopd_data.ABILITY:
        rows = pq.read_table(built / d / "train.parquet").to_pylist()
        assert [r["extra_info"]["block"] for r in rows] == [i // 4 for i in range(len(rows))]
        assert {r["extra_info"]["domain"] for r in rows} == {d}
        assert {r["ability"] for r in rows} == {mopd_data.ABILITY[d]}
        assert all([m["role"] for m in r["prompt"]] == ["user"] for r in rows)
        assert all(r["reward_model"]["style"] == "rule" for r in rows)
        assert len({r["prompt"][0]["content"] for r in rows}) == len(rows)
    math_rows = pq.read_table(built / "math" / "train.parquet").to_pylist()
    assert all(r["prompt"][0]["content"].rstrip().endswith('after "Answer:".') for r in math_rows)  # kept
    assert all(r["data_source"] == "math_dapo" for r in math_rows)  # verl's DAPO scorer reads it
    assert not any("remainder when" in r["prompt"][0]["content"].lower() for r in math_rows)


def test_domain_formats(built):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    logic = pq.read_table(built / "logic" / "train.parquet").to_pylist()
    # MOPD paper: the Reasoning Gym default instruction (answer in <answer> tags) in the user turn, before the question
    assert all(r["prompt"][0]["content"].startswith(SYSTEM_PROMPTS["default"].strip()) for r in logic)
    meta = json.loads(logic[0]["extra_info"]["meta"])
    import reasoning_gym

    entry = reasoning_gym.create_dataset(meta["task"], size=meta["size"], seed=meta["seed"])[meta["index"]]
    assert entry["answer"] == logic[0]["reward_model"]["ground_truth"]  # the reward can rebuild the scorer
    code = pq.read_table(built / "code" / "train.parquet").to_pylist()
    assert all(r["prompt"][0]["content"].startswith("Given an integer n") for r in code)  # the statement, no "-"
    safety = pq.read_table(built / "safety" / "train.parquet").to_pylist()
    truths = [r["reward_model"]["ground_truth"] for r in safety]
    assert truths.count("refuse") == truths.count("comply") == 6  # half STAR-1 harmful, half STAR-benign
    assert truths[:6] != ["refuse"] * 6  # mixed across blocks
    ifr = pq.read_table(built / "if" / "train.parquet").to_pylist()
    assert all(r["prompt"][0]["content"].startswith("Write a haiku") for r in ifr)  # first user turn


def test_build_is_deterministic_and_seeded(built, tiny, tmp_path):
    assert main(_args(tmp_path / "again", tiny)) == 0
    for d in mopd_data.ABILITY:
        again = pq.read_table(tmp_path / "again" / d / "train.parquet")
        assert again.equals(pq.read_table(built / d / "train.parquet"))
    assert main(_args(tmp_path / "seed1", tiny, "--seed", "1", "--domains", "math")) == 0
    a = pq.read_table(tmp_path / "seed1" / "math" / "train.parquet").column("prompt").to_pylist()
    assert a != pq.read_table(built / "math" / "train.parquet").column("prompt").to_pylist()


def test_verl_reads_the_files_as_the_trainer_does(built, tiny):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(str(tiny.student))
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 2048, "filter_overlong_prompts": True,
                            "truncation": "error", "return_raw_chat": True})
    ds = RLHFDataset(str(built / "safety" / "train.parquet"), tok, cfg)
    assert len(ds) == 12  # nothing lost to verl's own length filter
    assert ds[5]["extra_info"]["block"] == 1 and ds[5]["reward_model"]["ground_truth"] in ("refuse", "comply")


@pytest.mark.parametrize("flag, text, message", [
    ("--code", '{"id": 1, "problem": "p"}\n', r"OpenCodeReasoning file lacks column\(s\) \['input'\]"),
    ("--math", '{"prompt": "p"}\n', r"DAPO-Math-17k file lacks column\(s\) \['reward_model'\]"),
    ("--math", '{"prompt": "p", "reward_model": {"style": "rule"}}\n',
     "'reward_model' must be a dict with 'ground_truth'"),
    ("--safety-benign", '{"prompt": "p"}\n', r"STAR-benign-915 file lacks column\(s\) \['question'\]"),
    ("--if", '{"text": "p"}\n', "lacks column 'messages'"),
])
def test_bad_source_files_name_the_file_and_column_and_write_nothing(tiny, tmp_path, flag, text, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    args = _args(tmp_path / "out", tiny)
    args[args.index(flag) + 1] = str(bad)
    with pytest.raises(ValueError, match=message) as e:
        main(args)
    assert str(bad) in str(e.value)
    assert not (tmp_path / "out").exists()  # every domain is checked before any file is written


def test_too_few_prompts_is_an_error(tiny, tmp_path):
    args = _args(tmp_path / "out", tiny, "--domains", "code")
    args[args.index("--blocks") + 1] = "code=4"
    with pytest.raises(ValueError, match="domain code: only 10 usable prompts .* 16 needed"):
        main(args)
