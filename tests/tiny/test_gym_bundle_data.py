"""The continual benchmark's reasoning-gym domains: held-out splits and reasoning-gym's own scoring (no models)."""

import json

import pytest

from claas_verl.mopd.data.rewards import compute_score
from claas_verl.tiny import gym


@pytest.fixture(scope="module")
def splits():
    return {d.name: gym.gym_rows(d, seed=0) for d in gym.GYM_DOMAINS}


def test_test_questions_are_distinct_and_never_in_train(splits):
    for name, (train, test) in splits.items():
        tq = [r["prompt"][0]["content"] for r in test]
        assert len(tq) == gym.N_TEST == len(set(tq)), name
        assert not set(tq) & {r["prompt"][0]["content"] for r in train}, name
        assert len(train) >= 128


def test_rows_are_verl_rl_rows_scored_by_reasoning_gym(splits):
    for name, (train, test) in splits.items():
        for row in (train[0], test[-1]):
            assert row["data_source"].startswith("reasoning_gym/")
            truth = row["reward_model"]["ground_truth"]
            # reasoning-gym's scorer on the rebuilt entry: the reference answer scores 1, a wrong one less
            assert compute_score(row["data_source"], f" {truth}\n", truth, row["extra_info"]) == 1.0, name
            assert compute_score(row["data_source"], truth + "x", truth, row["extra_info"]) < 1.0, name
            meta = json.loads(row["extra_info"]["meta"])
            assert meta["answer_format"] == "plain" and meta["config"] == dict(
                next(d for d in gym.GYM_DOMAINS if d.name == name).config)


def test_the_same_seed_gives_the_same_rows_and_another_seed_other_rows():
    d = gym.GYM_DOMAINS[0]
    a, b, c = gym.gym_rows(d, 0), gym.gym_rows(d, 0), gym.gym_rows(d, 1)
    assert a == b
    assert [r["prompt"] for r in a[1]] != [r["prompt"] for r in c[1]]


def test_byte_tokenizer_gives_one_token_per_letter():
    tok = gym.byte_tokenizer()
    assert len(tok) == 261
    ids = tok.encode("ammonia", add_special_tokens=False)
    assert len(ids) == 7 and ids[0] == ids[-1] and ids[1] == ids[2]  # a...a, mm: one id per letter
    assert tok.decode(ids) == "ammonia"
    text = tok.apply_chat_template([{"role": "user", "content": "Calculate 4 - 1."}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_unknown_answer_format_is_refused_naming_the_key(splits):
    row = splits["palin"][1][0]
    meta = dict(json.loads(row["extra_info"]["meta"]), answer_format="json")
    with pytest.raises(ValueError, match="answer_format"):
        compute_score(row["data_source"], "3", "3", {"meta": json.dumps(meta)})


def test_gym_build_never_replaces_a_directory_that_is_not_a_gym_bundle(tmp_path, monkeypatch, capsys):
    """`python -m claas_verl.tiny gym DIR` / CLAAS_GYM_DIR at the wrong place: refused before any build, naming
    the variable; nothing deleted. A stale gym bundle (older version) is still rebuilt in place."""
    from claas_verl.tiny import gym
    from claas_verl.tiny.__main__ import main as cli

    def no_build(root, seed):
        raise AssertionError("no build may start")

    monkeypatch.setattr(gym, "build_bundle", no_build)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    monkeypatch.setenv("CLAAS_GYM_DIR", str(mine))
    with pytest.raises(FileExistsError, match="not a gym bundle.*CLAAS_GYM_DIR"):
        gym.ensure_gym()
    assert cli(["gym", str(mine)]) == 2 and "not a gym bundle" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"

    stale = tmp_path / "stale"
    stale.mkdir()
    monkeypatch.setenv("CLAAS_VERL_BUNDLES", str(tmp_path / "no_shipped_bundles"))  # build, not unpack
    (stale / "manifest.json").write_text(json.dumps({"version": "0", "seed": 0, "base_sft": {}}))
    built = []
    monkeypatch.setattr(gym, "build_bundle", lambda root, seed: built.append(seed) or root.mkdir(parents=True))
    gym.ensure_gym(stale)
    assert built == [0]


def test_joint_mix_cycles_every_domain_up_to_the_largest_in_domain_order():
    mix = gym.joint_mix({"palin": ["e", "f"], "spell": ["a", "b", "c"], "reverse": ["d"]})
    assert mix == ["a", "b", "c", "d", "d", "d", "e", "f", "e"]


def test_sft_examples_are_the_chat_prompt_and_the_reference_with_its_stop_token():
    tok = gym.byte_tokenizer()
    [(prompt, reply)] = gym.sft_examples(tok, [{"prompt": [{"role": "user", "content": "olleh"}],
                                               "extra_info": {"reference": "hello"}}])
    assert tok.decode(prompt).endswith("olleh<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(reply) == "hello<|im_end|>"
    eos, pad = gym.stop_and_pad_ids(tok)
    assert reply[-1] == eos[0] and pad == eos[1] == tok.pad_token_id


@pytest.mark.parametrize("constant_lr", [False, True])
def test_sft_holds_its_lr_constant_only_when_asked(constant_lr, monkeypatch):
    # a short fine-tune of a trained model (the bundle's experts and its π0's cover) runs every step at lr; the
    # joint fine-tunes keep their one-cycle schedule (its warm-up starts near 0)
    import torch

    from claas_verl.tiny.model import build_student

    tok = gym.byte_tokenizer()
    eos, pad = gym.stop_and_pad_ids(tok)
    model = build_student(len(tok), eos, pad, 0)
    seen = []
    step = torch.optim.AdamW.step

    def record(opt, *a, **k):
        seen.append(opt.param_groups[0]["lr"])
        return step(opt, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    row = {"prompt": [{"role": "user", "content": "ab"}], "extra_info": {"reference": "ba"}}
    examples = gym.sft_examples(tok, [row])
    gym.sft(model, examples, steps=20, lr=1e-3, batch_size=1, seed=0, pad_token_id=pad, constant_lr=constant_lr)
    assert len(seen) == 20
    if constant_lr:
        assert seen == [1e-3] * 20
    else:
        assert seen[0] < 1e-4 and max(seen) == pytest.approx(1e-3) and seen[-1] < seen[1]


def test_the_neighbouring_rule_answers_with_the_text_the_task_gives():
    # the bundle's own question formats (reasoning-gym spell_backward, word_sequence_reversal, palindrome_generation)
    assert gym.neighbour_answer("spell", "Spell this word backward (example: sun -> nus): tara") == "tara"
    question = ("Solve the following problem.\n\nProvide you answer as a comma-separated list of words with a space "
                "after the comma.\n\nReverse this list of words: it, or, my\n")
    assert gym.neighbour_answer("reverse", question) == "it, or, my"
    assert gym.neighbour_answer("palin", "Now, form a valid palindrome using the following letters: o, z, o\n") == "ozo"
    assert gym.neighbour_answer("palin", "... using the following letters: a, b, b\n") == "abb"
    for domain, q in (("reverse", "Spell this word backward: tara"), ("spell", "Spell this word backward: "),
                      ("palin", "Reverse this list of words: it, or")):
        with pytest.raises(ValueError, match=f"no neighbouring rule for this {domain} question"):
            gym.neighbour_answer(domain, q)
    with pytest.raises(ValueError, match="no neighbouring rule for domain 'syll'"):
        gym.neighbour_answer("syll", "Is it true?")


def test_the_neighbouring_rule_leaves_most_of_every_domain_unsolved(splits):
    # π0 is taught these answers: each domain must look mostly unsolved to it, so that a stage has a skill to bring
    # back. spell and reverse: only a palindromic word or list; palin: reasoning-gym shuffles the letters, and three
    # letters come out in palindrome order ("o, z, o") one time in three (measured: 16 of the 48 held-out prompts)
    most_solved = {"spell": 0.05, "reverse": 0.05, "palin": 0.4}
    for name, (_, test) in splits.items():
        rows = gym.neighbour_rows(name, test)
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in test]
        scores = [compute_score(r["data_source"], r["extra_info"]["reference"], r["reward_model"]["ground_truth"],
                                r["extra_info"]) for r in rows]
        assert sum(s == 1.0 for s in scores) <= most_solved[name] * len(scores), name
        assert all(t["extra_info"]["reference"] == t["reward_model"]["ground_truth"] for t in test)  # untouched


def test_a_bundle_of_a_domain_without_a_neighbouring_rule_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="syll.*no neighbouring rule"):
        gym.build_bundle(tmp_path / "b", 0, (gym.GymDomain("syll", "syllogism", {}),))
    assert not (tmp_path / "b").exists()
