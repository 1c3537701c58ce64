"""Reward mapping of docs/math.md §A.1.4 / CLaaS paper (zh) App. A.3 and the Scenario interface
(claas_verl.claas.envs.base)."""

import pytest

from claas_verl.claas.envs import Grade, GraderError, Scenario, Verdict, grade_response, strip_thinking, user_context
from claas_verl.claas.envs.base import EMPTY_FEEDBACK, GENERIC_FAIL_FEEDBACK, UNCLOSED_THINK_FEEDBACK


class Recorder:
    """Verifier that passes iff 'ok' is in the visible text, and records what it was shown."""

    def __init__(self):
        self.seen = []

    def __call__(self, visible, context):
        self.seen.append((visible, context))
        return Verdict(True) if "ok" in visible else Verdict(False, "said no ok")


def test_strip_thinking_cases():
    assert strip_thinking("<think>plan</think>\n answer ").text == "answer"
    # several blocks: everything up to the LAST close is reasoning
    assert strip_thinking("<think>a</think>x<think>b</think>y").text == "y"
    # prompt opened the block: the response only closes it
    assert strip_thinking("plan</think>answer", think_opened_in_prompt=True).text == "answer"
    assert strip_thinking("plain answer").text == "plain answer"
    assert strip_thinking("plain answer").unclosed is False
    v = strip_thinking("<think>never ends")
    assert v.unclosed and v.text == ""
    assert strip_thinking("no tags at all", think_opened_in_prompt=True).unclosed


def test_thinking_is_stripped_before_grading():
    rec = Recorder()
    # the thinking mentions "ok" but the visible answer does not: the grader must only see "nope"
    g = grade_response(rec, "<think>ok ok ok</think>nope", "ctx")
    assert rec.seen == [("nope", "ctx")]
    assert g == Grade(0.0, "said no ok")
    assert grade_response(rec, "<think>hmm</think> ok!", "ctx") == Grade(1.0, None)


def test_unclosed_think_is_zero_without_calling_grader():
    rec = Recorder()
    g = grade_response(rec, "<think>ok ok ok and then the length limit hit", "ctx")
    assert g == Grade(0.0, UNCLOSED_THINK_FEEDBACK)
    assert rec.seen == []


@pytest.mark.parametrize("resp", ["", "   \n", "<think>x</think>   "])
def test_empty_response_is_zero(resp):
    rec = Recorder()
    assert grade_response(rec, resp, "ctx") == Grade(0.0, EMPTY_FEEDBACK)
    assert rec.seen == []


def test_grader_error_is_none_and_other_exceptions_propagate():
    def broken(visible, context):
        raise GraderError("timeout")

    assert grade_response(broken, "hello", "") == Grade(None, None)
    assert grade_response(broken, "hello", "").is_error

    def buggy(visible, context):
        raise KeyError("bug in trusted verifier")

    with pytest.raises(KeyError):
        grade_response(buggy, "hello", "")


def test_fail_without_feedback_gets_generic_text_and_pass_gets_none():
    assert grade_response(lambda v, c: Verdict(False), "x", "") == Grade(0.0, GENERIC_FAIL_FEEDBACK)
    # a verifier that attaches feedback to a pass: docs/math.md §A.3.3 says passing steps carry None
    assert grade_response(lambda v, c: Verdict(True, "great"), "x", "") == Grade(1.0, None)


def test_scenario_grade_context_and_messages():
    rec = Recorder()
    s = Scenario("s1", "SYS", ("u0", "u1", "u2"), rec)
    assert user_context(s.user_turns, 1) == "u0\n\nu1"
    assert s.grade("ok", 1).reward == 1.0
    assert rec.seen[-1] == ("ok", "u0\n\nu1")
    assert s.messages(2, ["a0", "a1"]) == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert s.messages(0, [], system_prompt="ICL SYS")[0]["content"] == "ICL SYS"
    with pytest.raises(ValueError, match="turn"):
        s.grade("ok", 3)
    with pytest.raises(ValueError, match="earlier replies"):
        s.messages(2, ["a0"])
    with pytest.raises(ValueError, match="user_turns"):
        Scenario("s2", "SYS", (), rec)
