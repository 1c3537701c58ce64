"""Answer extraction edge cases from the MOPD paper App. C ("Evaluation details", "Truncation and answer
extraction")."""

from __future__ import annotations

from collections import Counter

from claas_verl.mopd.eval import extract


def test_split_thinking_closed_unclosed_and_repeated():
    assert extract.split_thinking("<think>plan</think>\nfinal") == ("final", True)
    # R1-style templates open <think> in the prompt: the response only closes it
    assert extract.split_thinking("plan...</think>answer") == ("answer", True)
    # truncated inside the reasoning: the whole response, flagged unclosed
    assert extract.split_thinking("<think>still thinking") == ("<think>still thinking", False)
    # a quoted </think> earlier: the text after the LAST one is the answer
    assert extract.split_thinking("a</think>b</think> c ") == ("c", True)


def test_last_boxed_nested_multiple_and_inside_thinking():
    assert extract.last_boxed(r"\boxed{\frac{1}{2}} then \boxed{3}") == "3"
    assert extract.last_boxed(r"x = \boxed{\frac{a^{2}}{b}}") == r"\frac{a^{2}}{b}"
    assert extract.last_boxed(r"\fbox{7}") == "7"
    # a box drafted in the thinking counts only when nothing later is boxed
    assert extract.last_boxed(r"<think>maybe \boxed{A}</think>The answer is \boxed{B}.") == "B"
    assert extract.last_boxed(r"<think>maybe \boxed{A} hmm, truncated") == "A"
    # no box, and a box cut off by truncation (unbalanced) gives no answer
    assert extract.last_boxed("Answer: 5") is None
    assert extract.last_boxed(r"\boxed{12} and finally \boxed{1") == "12"
    assert extract.last_boxed(r"\boxed{\frac{1}{") is None


def test_unwrap_latex():
    assert extract.unwrap_latex(r"$\text{ False }$") == "False"
    assert extract.unwrap_latex(r"\textbf{\text{(A)}}") == "(A)"
    assert extract.unwrap_latex("  Yes ") == "Yes"


def test_lenient_answer_order():
    assert extract.lenient_answer(r"<answer>x</answer> \boxed{y}") == "y"
    assert extract.lenient_answer("<answer> x </answer> then <ANSWER>z</ANSWER>") == "z"
    assert extract.lenient_answer("so\nAnswer: 42\nmore") == "42"
    assert extract.lenient_answer("nothing here") is None


def test_musr_choice_reads_last_answer_line_any_case_thinking_included():
    choices = ["Tom", "Mia", "Ann"]
    assert extract.musr_choice("ANSWER: 2", choices, 0) == (1, True)
    # last line with "answer:" wins, even inside an unclosed thinking block
    assert extract.musr_choice("<think>answer: 1\nwait\nfinal answer: 3", choices, 0) == (2, True)
    assert extract.musr_choice("Answer: (2)", choices, 0) == (1, True)
    # named by its text
    assert extract.musr_choice("Answer: it was ann", choices, 0) == (2, True)


def test_musr_random_option_is_seeded_and_covers_the_options():
    choices = ["a", "b", "c"]
    for bad in ("no answer line at all", "ANSWER: 7", "answer: none of them", "Answer:"):
        i, from_line = extract.musr_choice(bad, choices, 123)
        assert not from_line and 0 <= i < 3
        assert extract.musr_choice(bad, choices, 123) == (i, False)  # same seed, same option
    picks = Counter(extract.musr_choice("", choices, s)[0] for s in range(300))
    assert set(picks) == {0, 1, 2} and min(picks.values()) > 60


def test_last_code_block():
    text = "```python\nx = 1\n```\ntext\n```\ny = 2\n```"
    assert extract.last_code_block(text) == "y = 2\n"
    assert extract.last_code_block("no code") is None
