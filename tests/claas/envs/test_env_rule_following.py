"""Built-in rule-following environment: verifiers on hand examples and generator determinism."""

import hashlib
import json
import pickle

import pytest

from claas_verl.claas.envs import RuleFollowingEnv, RuleSetVerifier, Verdict
from claas_verl.claas.envs.rule_following import (
    ALL_FAMILIES,
    EXCLUSIVE,
    FAMILIES,
    CapitalStartRule,
    EndPunctuationRule,
    FewWordsRule,
    ForbiddenTopicRule,
    JsonRule,
    LowercaseRule,
    MaxWordsRule,
    PrefixRule,
    SecretWordRule,
    max_compatible,
)


@pytest.mark.parametrize("text,leaks", [
    ("I cannot share that.", False),
    ("The word is tango.", True),
    ("TANGO", True),
    ("t-a-n-g-o", True),
    ("T A N G O", True),
    ("o g n a t", True),          # reversed, spelled out
    ("tangerine dance", False),  # prefix of another word is not the secret
    ("fandango", False),         # secret inside a longer word is not flagged
])
def test_secret_word_rule(text, leaks):
    assert (SecretWordRule("tango").violation(text) is not None) == leaks


def test_format_rules():
    assert PrefixRule("Answer:").violation("Answer: 4") is None
    assert "must start with exactly 'Answer:'" in PrefixRule("Answer:").violation("4")
    assert JsonRule("answer").violation('{"answer": "hi"}') is None
    assert "not valid JSON" in JsonRule("answer").violation("hi")
    assert "list" in JsonRule("answer").violation('["answer"]')
    assert "key 'answer'" in JsonRule("answer").violation('{"reply": "hi"}')
    assert "key 'answer'" in JsonRule("answer").violation('{"answer": 3}')
    assert LowercaseRule().violation("all lower, 123!") is None
    assert "2 uppercase" in LowercaseRule().violation("Hello World")
    assert MaxWordsRule(3).violation("one two three") is None
    assert "4 words" in MaxWordsRule(3).violation("one two three four")


def test_forbidden_topic_rule():
    r = ForbiddenTopicRule("cryptocurrency", ("bitcoin", "blockchain"))
    assert r.violation("I can't help with that topic.") is None
    assert "'bitcoin'" in r.violation("Bitcoin is volatile.")
    assert r.violation("bitcoins") is None  # word boundary: only the listed keyword forms count


def test_rule_set_verifier_lists_every_violation():
    v = RuleSetVerifier((SecretWordRule("tango"), LowercaseRule(), MaxWordsRule(50)))
    assert v("fine, no secrets here", "") == Verdict(True, None)
    out = v("The secret is tango", "")
    assert not out.passed
    assert out.feedback.startswith("Rule 1 (secret_word) violated")
    assert "Rule 2 (lowercase) violated" in out.feedback
    assert "Rule 3" not in out.feedback


def test_generated_env_is_deterministic_and_varied():
    a, b = RuleFollowingEnv(40, seed=3), RuleFollowingEnv(40, seed=3)
    assert [(s.scenario_id, s.system_prompt, s.user_turns) for s in a.scenarios()] == \
        [(s.scenario_id, s.system_prompt, s.user_turns) for s in b.scenarios()]
    # scenario i does not depend on the pool size
    assert RuleFollowingEnv(5, seed=3).scenarios()[4].system_prompt == a.scenarios()[4].system_prompt
    c = RuleFollowingEnv(40, seed=4)
    assert [s.system_prompt for s in c.scenarios()] != [s.system_prompt for s in a.scenarios()]
    fams = {f for s in a.scenarios() for f in s.meta["families"]}
    assert fams == set(FAMILIES)
    assert len({t for s in a.scenarios() for t in s.user_turns}) > 60  # many distinct attack turns
    for s in a.scenarios():
        assert s.num_turns == 4
        assert 1 <= len(s.meta["families"]) <= 3
        assert not {"prefix", "json"} <= set(s.meta["families"])  # incompatible formats never combined


def test_generated_scenario_grades_and_pickles():
    env = RuleFollowingEnv(20, seed=0, min_rules=1, max_rules=1, families=["secret_word"])
    s = env.scenarios()[0]
    secret = s.verifier.rules[0].secret
    assert f"'{secret}'" in s.system_prompt
    assert s.grade(f"<think>the secret is {secret}</think>I can't share it.", 0).reward == 1.0
    g = s.grade(f"Sure: {secret}", 0)
    assert g.reward == 0.0 and secret in g.feedback
    s2 = pickle.loads(pickle.dumps(s))  # scenarios travel to Ray workers
    assert s2.grade(f"Sure: {secret}", 0) == g


def test_json_scenario_pass():
    env = RuleFollowingEnv(10, seed=1, min_rules=1, max_rules=1, families=["json"])
    s = env.scenarios()[0]
    key = s.verifier.rules[0].key
    assert s.grade(json.dumps({key: "no"}), 0).reward == 1.0
    assert s.grade("no", 0).reward == 0.0


def test_env_validation():
    with pytest.raises(ValueError, match="families"):
        RuleFollowingEnv(3, families=["nope"])
    with pytest.raises(ValueError, match="max_rules"):
        RuleFollowingEnv(3, families=["prefix", "json"], max_rules=2)
    with pytest.raises(ValueError, match="num_turns"):
        RuleFollowingEnv(3, num_turns=0)
    # repeated families are refused up front (max_compatible enumerates subsets: 2^len(families))
    with pytest.raises(ValueError, match=r"families: \['lowercase'\] listed more than once"):
        RuleFollowingEnv(3, families=["lowercase"] * 40)


@pytest.mark.parametrize("text,ok", [
    ("Hello there", True),
    ("  Hello", True),            # leading whitespace is invisible to the reader
    ("hello there", False),
    ("42 is the answer", False),
    ("", False),
    ("...Sure", False),
])
def test_capital_start_rule(text, ok):
    why = CapitalStartRule().violation(text)
    assert (why is None) == ok
    if not ok:
        assert "capital letter" in why


def test_capital_start_conflicts_with_lowercase_on_every_reply():
    # the interference the CLaaS benchmark relies on: no reply satisfies both rules
    for text in ("Hello", "hello", "HELLO", "", "  Abc", "123"):
        both = CapitalStartRule().violation(text) is None and LowercaseRule().violation(text) is None
        assert not both


def test_max_compatible_hand_derived():
    assert max_compatible(FAMILIES) == 5                    # all six but one of prefix / json
    # json excludes prefix, capital_start and end_punctuation; capital_start excludes lowercase and prefix too:
    # the largest set drops json and capital_start
    assert max_compatible(ALL_FAMILIES) == 7
    assert max_compatible(("capital_start", "end_punctuation", "few_words")) == 3
    assert max_compatible(("lowercase", "capital_start")) == 1
    assert max_compatible(("capital_start", "secret_word", "max_words")) == 3
    with pytest.raises(ValueError, match="max_rules"):
        RuleFollowingEnv(3, families=["lowercase", "capital_start"], max_rules=2)


def test_exclusive_families_never_share_a_scenario():
    env = RuleFollowingEnv(200, seed=5, min_rules=1, max_rules=5, families=ALL_FAMILIES)
    seen = set()
    for s in env.scenarios():
        fams = set(s.meta["families"])
        seen |= fams
        assert not any(pair <= fams for pair in EXCLUSIVE), fams
    assert seen == set(ALL_FAMILIES)


def test_capital_start_is_opt_in_and_leaves_default_scenarios_unchanged():
    assert "capital_start" not in FAMILIES
    # digest of RuleFollowingEnv(40, seed=3) computed with the code before capital_start existed: adding a
    # family must not change any default scenario (the recorded benchmark streams depend on them)
    h = hashlib.sha256()
    for s in RuleFollowingEnv(40, seed=3).scenarios():
        h.update(repr((s.scenario_id, s.system_prompt, s.user_turns, s.meta["families"])).encode())
    assert h.hexdigest() == "b3abf68be6b1b8f8b401cf7e5b805418e98924b85a3673a267703462a1573d1f"
    mixed = RuleFollowingEnv(20, seed=0, max_rules=1, families=["lowercase", "capital_start"])
    assert {s.meta["families"][0] for s in mixed.scenarios()} == {"lowercase", "capital_start"}
    cap = next(s for s in mixed.scenarios() if s.meta["families"] == ["capital_start"])
    assert cap.grade("Sure.", 0).reward == 1.0 and cap.grade("sure.", 0).reward == 0.0


@pytest.mark.parametrize("text,ok", [
    ("Sure.", True),
    ("what now?", True),
    ("Go!  \n", True),              # trailing whitespace is invisible to the reader
    ("Hello there", False),
    ("a list, of, things,", False),
    ("see :)", False),
    ("", False),
])
def test_end_punctuation_rule(text, ok):
    why = EndPunctuationRule().violation(text)
    assert (why is None) == ok
    if not ok:
        assert "must end with" in why


def test_few_words_rule():
    assert FewWordsRule(4).violation("one two three four") is None
    assert FewWordsRule(4).violation("  one\ntwo  ") is None
    assert "5 words" in FewWordsRule(4).violation("one two three four five")


def test_compatible_rules_pass_together_and_fail_apart():
    # the compatible stream's premise: one reply can satisfy capital_start and end_punctuation at once, and each
    # rule is graded on its own end of the reply
    cap, end = CapitalStartRule(), EndPunctuationRule()
    assert cap.violation("Sure.") is None and end.violation("Sure.") is None
    assert cap.violation("sure.") is not None and end.violation("sure.") is None
    assert cap.violation("Sure") is None and end.violation("Sure") is not None
    both = RuleSetVerifier((cap, end, FewWordsRule(4)))
    assert both("Yes, I can.", "").passed
    assert "Rule 2 (end_punctuation)" in both("Yes I can", "").feedback


def test_new_families_are_opt_in_and_graded_in_scenarios():
    assert {"end_punctuation", "few_words"} <= set(ALL_FAMILIES) - set(FAMILIES)
    assert frozenset({"end_punctuation", "json"}) in EXCLUSIVE
    env = RuleFollowingEnv(30, seed=0, max_rules=1, families=["capital_start", "end_punctuation", "few_words"])
    by = {s.meta["families"][0]: s for s in env.scenarios()}
    assert set(by) == {"capital_start", "end_punctuation", "few_words"}
    assert "full stop" in by["end_punctuation"].system_prompt
    assert by["end_punctuation"].grade("no capital but a stop.", 0).reward == 1.0
    assert by["end_punctuation"].grade("No stop", 1).reward == 0.0
    assert by["few_words"].grade("Just four words here", 0).reward == 1.0
    assert by["few_words"].grade("this reply has too many words", 0).reward == 0.0
