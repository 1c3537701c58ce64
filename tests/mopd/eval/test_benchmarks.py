"""Loaders and scorers of every benchmark on hand-made fixture files shaped like the real ones (no downloads)."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest

from claas_verl.mopd.eval import benchmarks

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "eval"


@pytest.fixture(scope="module")
def data():
    return benchmarks.resolve_data(str(FIX), {})


def test_settings_match_003_table():
    # MOPD paper App. C: samples per item, temperature, max new tokens; top-p 0.95 everywhere
    assert benchmarks.SETTINGS["BBH"] == benchmarks.Setting(1, 0.7, 8192)
    assert benchmarks.SETTINGS["AIME25"] == benchmarks.Setting(16, 0.6, 31744)
    assert benchmarks.SETTINGS["LCB-e"] == benchmarks.Setting(4, 0.6, 16384)
    assert benchmarks.SETTINGS["MBPP"] == benchmarks.Setting(2, 0.7, 16384)
    assert benchmarks.SETTINGS["IFBench"] == benchmarks.Setting(4, 0.6, 16384)
    assert {s.top_p for s in benchmarks.SETTINGS.values()} == {0.95}
    # the 14 scores of claas_verl.metrics (+ XSTest-unsafe) come out of the 13 generation benchmarks
    from claas_verl.metrics.mopd import ALL_BENCHMARKS
    out = {k for b in benchmarks.SETTINGS for k in benchmarks.scores_of(b)}
    assert out == set(ALL_BENCHMARKS) | {"XSTest-unsafe"}
    assert len(benchmarks.GYM_TASKS) == 38


def test_resolve_data_finds_default_names(data):
    assert {"BBH", "MuSR", "AIME24", "Minerva", "MBPP", "LCB-e", "StrongREJECT", "WildJailbreak", "XSTest",
            "IFEval", "IFBench"} == set(data)
    with pytest.raises(ValueError, match="AIME25.*--data-dir"):
        benchmarks.load("AIME25", data)


def test_bbh_prompt_and_normalised_match(data):
    items = benchmarks.load("BBH", data)
    assert len(items) == 4 and {it["subtask"] for it in items} == {"boolean_expressions", "date_understanding"}
    assert items[0]["messages"][0]["content"].endswith(benchmarks.BOXED_INSTRUCTION)
    mc = next(it for it in items if it["target"] == "(B)")
    for ok in (r"\boxed{B}", r"\boxed{(B)}", r"\boxed{\text{(B) 12/25/1937}}", r"<think>\boxed{A}</think>\boxed{b}"):
        assert benchmarks.score_bbh(mc, ok)["score"] == 1.0, ok
    for bad in (r"\boxed{A}", "The answer is (B)", r"\boxed{BA}"):
        assert benchmarks.score_bbh(mc, bad)["score"] == 0.0, bad
    tf = next(it for it in items if it["target"] == "False")
    assert benchmarks.score_bbh(tf, r"\boxed{false.}")["score"] == 1.0  # lm-eval: case and a final period ignored
    # the MOPD paper's alternative reading (<answer> tags) is reported beside the official score, not instead of it
    r = benchmarks.score_bbh(tf, "<answer>False</answer>")
    assert (r["score"], r["lenient_score"], r["answer"]) == (0.0, 1.0, None)


def test_gym_items_and_reasoning_gym_scorer():
    items = benchmarks.load_gym(("basic_arithmetic", "letter_counting"), per_task=3, seed=4242)
    assert [it["id"] for it in items] == [f"{t}/{i}" for t in ("basic_arithmetic", "letter_counting") for i in range(3)]
    assert items == benchmarks.load_gym(("basic_arithmetic", "letter_counting"), per_task=3, seed=4242)  # seeded
    truth = benchmarks.gym_dataset("basic_arithmetic", 3, 4242)[0]["answer"]
    assert benchmarks.score_gym(items[0], rf"\boxed{{{truth}}}")["score"] == 1.0
    assert benchmarks.score_gym(items[0], f"<answer>{truth}</answer>")["score"] == 0.0  # GYM reads the box only
    assert benchmarks.score_gym(items[0], f"<answer>{truth}</answer>")["lenient_score"] == 1.0
    assert benchmarks.score_gym(items[0], "truncated mid-thought")["score"] == 0.0


def test_musr_prompt_and_scoring(data):
    items = benchmarks.load("MuSR", data)
    text = items[1]["messages"][0]["content"]
    assert "1 - shelf\n2 - drawer\n3 - car" in text and "ANSWER:" in text and not text.endswith("Answer:")
    assert benchmarks.score_musr(items[1], "thinking...\nANSWER: 2")["score"] == 1.0
    assert benchmarks.score_musr(items[1], "answer: 1")["score"] == 0.0
    r = benchmarks.score_musr(items[1], "I am not sure.", sample=0)
    assert r["random_option"] and r == benchmarks.score_musr(items[1], "I am not sure.", sample=0)


def test_math_loaders_and_math_verify(data):
    aime, minerva = benchmarks.load("AIME24", data), benchmarks.load("Minerva", data)
    assert [it["target"] for it in aime] == ["24", r"\frac{3}{4}"]
    assert [it["target"] for it in minerva] == ["60", "4"]  # the last box of the reference solution
    assert benchmarks.score_math(aime[1], r"... so \boxed{0.75}")["score"] == 1.0
    assert benchmarks.score_math(aime[1], r"\boxed{3/4}")["score"] == 1.0
    assert benchmarks.score_math(aime[0], r"\boxed{25}")["score"] == 0.0
    assert benchmarks.score_math(aime[0], "Answer: 24")["score"] == 0.0  # no box: no answer
    assert benchmarks.score_math(minerva[1], r"<think>\boxed{2}</think> so \boxed{4}")["score"] == 1.0


def test_mbpp_plus_prompt_is_lm_evals_and_tests_run_in_the_sandbox(data):
    items = benchmarks.load("MBPP", data)
    assert items[0]["messages"][0]["content"] == (
        "Write a function to find the shared elements from the given two lists. Your code should satisfy the "
        "following assertion:\nassert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))")
    good = "```python\ndef similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n```"
    scores = benchmarks.score_mbpp(items[0], good)
    assert scores["MBPP"] == 1.0 and scores["MBPP+"] == 1.0
    # passes the base tests, fails the extended ones (empty input)
    weak = "```python\ndef similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b))) if a else None\n```"
    assert (benchmarks.score_mbpp(items[0], weak)["MBPP"], benchmarks.score_mbpp(items[0], weak)["MBPP+"]) == (1.0, 0.0)
    # MOPD paper: thinking stripped before extraction -- a correct draft inside the thinking does not count
    draft = f"<think>{good}</think>\n```python\ndef similar_elements(a, b):\n    return ()\n```"
    assert benchmarks.score_mbpp(items[0], draft)["MBPP"] == 0.0
    assert benchmarks.score_mbpp(items[0], "I could not solve it.")["MBPP"] == 0.0
    # floats compared with tolerance (atol), ints vs floats by value
    perimeter = "```python\ndef square_perimeter(a):\n    return a + a + a + a\n```"
    assert benchmarks.score_mbpp(items[1], perimeter)["MBPP+"] == 1.0


def test_model_code_cannot_escape_the_sandbox(data, tmp_path):
    item = benchmarks.load("MBPP", data)[1]
    target = tmp_path / "pwned"
    # (EvalPlus' sanitize keeps only the entry point and what it uses, so the attacks sit inside it)
    evil = (f"```python\ndef square_perimeter(a):\n    open({str(target)!r}, 'w').write('x')\n"
            "    return 4 * a\n```")
    assert benchmarks.score_mbpp(item, evil)["MBPP"] == 0.0 and not target.exists()
    net = ("```python\nimport socket\ndef square_perimeter(a):\n    socket.create_connection(('127.0.0.1', 9))\n"
           "    return 4 * a\n```")
    # the sandbox's seccomp filter makes process creation fail (os.system returns an error, it does not raise):
    # what must not happen is the side effect
    spawned = tmp_path / "spawned"
    shell = (f"```python\nimport os\ndef square_perimeter(a):\n    os.system('touch {spawned}')\n"
             "    return 4 * a\n```")
    benchmarks.score_mbpp(item, shell)
    assert not spawned.exists()
    assert benchmarks.score_mbpp(item, net)["MBPP"] == 0.0
    spin = "```python\ndef square_perimeter(a):\n    while True:\n        pass\n```"
    assert benchmarks.score_mbpp(item, spin, timeout_s=1.0)["MBPP"] == 0.0


def test_lcb_window_stdin_functional_and_compressed_tests(data, tmp_path):
    items = benchmarks.load("LCB-e", data)
    # the 2024-03 problem is outside the MOPD paper's scored window
    assert [it["id"] for it in items] == ["abc1", "lc1"]
    ok = "</think>```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert benchmarks.score_lcb(items[0], ok)["score"] == 1.0
    assert benchmarks.score_lcb(items[0], "```python\nprint(3)\n```")["score"] == 0.0  # passes the public test only
    fn = "```python\nclass Solution:\n    def double(self, n: int) -> int:\n        return 2 * n\n```"
    assert benchmarks.score_lcb(items[1], fn)["score"] == 1.0
    # the "lite" release compresses private tests: base64(zlib(pickle(json))); only plain data may unpickle
    rows = [json.loads(line) for line in (FIX / "livecodebench.jsonl").read_text().splitlines()]
    packed = base64.b64encode(zlib.compress(pickle.dumps(rows[0]["private_test_cases"]))).decode()
    (tmp_path / "lcb.jsonl").write_text(json.dumps({**rows[0], "private_test_cases": packed}) + "\n")
    (it,) = benchmarks.load_lcb(tmp_path / "lcb.jsonl")
    assert it["tests"] == items[0]["tests"]
    evil = base64.b64encode(zlib.compress(pickle.dumps(Path("x")))).decode()
    (tmp_path / "evil.jsonl").write_text(json.dumps({**rows[0], "private_test_cases": evil}) + "\n")
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        benchmarks.load_lcb(tmp_path / "evil.jsonl")


def test_ifeval_verified_after_thinking(data):
    items = benchmarks.load("IFEval", data)
    check = benchmarks.if_checker(None)
    lower = items[0]
    assert benchmarks.score_if(lower, "<think>Let Me Think</think>\nthe sea is calm and wide", check) == {
        "score": 1.0, "closed": True}
    assert benchmarks.score_if(lower, "The sea", check)["score"] == 0.0
    assert benchmarks.score_if(items[1], "[a] [b] [c]", check)["score"] == 1.0
    assert benchmarks.score_if(items[1], "<think>[a] [b] [c]</think>[a]", check)["score"] == 0.0
    with pytest.raises(FileNotFoundError, match="evaluation_lib.py"):
        benchmarks.if_checker(str(FIX))


def test_safety_loaders_and_wildjailbreak_sample(data, tmp_path):
    assert len(benchmarks.load("StrongREJECT", data)) == 2 and len(benchmarks.load("WildJailbreak", data)) == 2
    assert [it["label"] for it in benchmarks.load("XSTest", data)] == ["safe", "unsafe"]
    rows = [{"adversarial": f"prompt {i}"} for i in range(300)]
    (tmp_path / "wj.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = benchmarks.load("WildJailbreak", {"WildJailbreak": tmp_path / "wj.jsonl"})
    assert len(a) == 250 and a == benchmarks.load("WildJailbreak", {"WildJailbreak": tmp_path / "wj.jsonl"})


@pytest.mark.parametrize("bench, text, message", [
    ("MuSR", '{"narrative": "n", "question": "q", "answer_index": 0}\n', r"lacks column\(s\) \['choices'\]"),
    ("MBPP", '{"task_id": "Mbpp/2", "prompt": "p"}\n', r"MbppPlus file lacks column\(s\) \['entry_point'"),
    ("IFEval", '{"key": 1, "prompt": "p"}\n', r"lacks column\(s\) \['instruction_id_list', 'kwargs'\]"),
    ("XSTest", '{"prompt": "p", "label": "maybe"}\n', "label.*'safe' or 'unsafe'"),
    ("AIME24", '{"question": "q"}\n', "lacks a column answer / Answer|no answer column"),
])
def test_bad_benchmark_files_name_the_file_and_column(tmp_path, bench, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        benchmarks.load(bench, {bench: path})
    assert str(path) in str(e.value)


def test_ifbench_through_a_checkout_of_the_ifbench_repo(data):
    items = benchmarks.load("IFBench", {"IFBench": FIX / "ifbench.jsonl"})
    check = benchmarks.if_checker(str(FIX / "ifbench_repo"))
    assert benchmarks.score_if(items[0], "<think>one two three four</think>cold wet grey", check)["score"] == 1.0
    assert benchmarks.score_if(items[0], "cold wet grey sky", check)["score"] == 0.0


def test_bbh_one_folder_per_subtask(tmp_path):
    (tmp_path / "bbh" / "navigate").mkdir(parents=True)
    (tmp_path / "bbh" / "navigate" / "test.jsonl").write_text('{"input": "Walk?", "target": "Yes"}\n' * 50)
    items = benchmarks.load("BBH", {"BBH": tmp_path / "bbh"})
    assert len(items) == benchmarks.BBH_ITEMS_PER_SUBTASK and items[0]["subtask"] == "navigate"
