"""Scenario interface: scenario → system prompt, user turns, verifier (docs/math.md §A.1.4-A.1.5); pools in
environment.py.

A :class:`Scenario` is what the rollout producer runs: a defender system prompt,
up to T attacker user turns (docs/math.md §A.1.5, T = 4 by default) and a verifier. After
each assistant reply the producer calls ``scenario.grade(response, turn)`` and
gets a :class:`Grade` whose reward follows docs/math.md §A.1.4 / CLaaS paper (zh) App. A.3:

===========================================  ===========  =========================
case                                         reward       feedback
===========================================  ===========  =========================
verifier passes                              1.0          None (docs/math.md §A.3.3)
verifier fails                               0.0          the violation, in words
visible text empty                           0.0          "empty response"
``<think>`` never closed (length exceeded)   0.0          "thinking never closed"
verifier raised / timed out / non-bool       None         None (entry is dropped)
===========================================  ===========  =========================

Verifiers receive only the visible text (thinking stripped) and the
concatenated user-role messages up to the graded turn (CLaaS paper App.: "the grader
receives the concatenated user-role messages (as context) and the model's
visible response text").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from claas_verl.claas.envs.thinking import strip_thinking
from claas_verl.sandbox.errors import GraderError  # what a verifier raises; the sandbox raises it too

DEFAULT_MAX_TURNS = 4  # docs/math.md §A.1.5 / CLaaS paper (zh) A.1.1: at most T = 4 rounds

EMPTY_FEEDBACK = "The response was empty: the assistant must always give a visible reply that follows the rules."
UNCLOSED_THINK_FEEDBACK = (
    "The thinking block was never closed (<think> without </think>): the reply was cut off at the length "
    "limit before any visible answer. Think briefly and always close </think> before answering."
)
GENERIC_FAIL_FEEDBACK = "The response violated at least one rule of the system prompt."


@dataclass(frozen=True)
class Grade:
    """One graded step. ``reward`` ∈ {1.0, 0.0} or None (grader error: never trained on, docs/math.md §A.1.4)."""

    reward: float | None
    feedback: str | None

    @property
    def is_error(self) -> bool:
        return self.reward is None


@dataclass(frozen=True)
class Verdict:
    """What a verifier says about a visible reply: pass/fail plus, on fail, why."""

    passed: bool
    feedback: str | None = None


@runtime_checkable
class Verifier(Protocol):
    """``verifier(visible_text, user_context) -> Verdict``; raises :class:`GraderError` on grader failure."""

    def __call__(self, visible_text: str, user_context: str) -> Verdict: ...


def user_context(user_turns: Sequence[str], turn: int) -> str:
    """Concatenated user-role messages up to and including ``turn`` (0-based), separated by blank lines."""
    return "\n\n".join(user_turns[: turn + 1])


def grade_response(
    verifier: Verifier,
    response: str,
    context: str,
    think_opened_in_prompt: bool = False,
) -> Grade:
    """Map a raw model response to a :class:`Grade` (the table in the module docstring).

    ``response`` is the decoded assistant text including any thinking; ``context``
    the concatenated user messages. Only :class:`GraderError` becomes None; any
    other exception from a trusted in-process verifier is a bug and propagates.
    """
    visible = strip_thinking(response, think_opened_in_prompt=think_opened_in_prompt)
    if visible.unclosed:
        return Grade(reward=0.0, feedback=UNCLOSED_THINK_FEEDBACK)
    if not visible.text:
        return Grade(reward=0.0, feedback=EMPTY_FEEDBACK)
    try:
        verdict = verifier(visible.text, context)
    except GraderError:
        return Grade(reward=None, feedback=None)
    if not isinstance(verdict, Verdict):
        raise TypeError(f"verifier {verifier!r} returned {type(verdict).__name__}, expected Verdict")
    if verdict.passed:
        return Grade(reward=1.0, feedback=None)  # docs/math.md §A.3.3: passing steps carry no feedback
    return Grade(reward=0.0, feedback=verdict.feedback or GENERIC_FAIL_FEEDBACK)


@dataclass(frozen=True)
class Scenario:
    """One defender scenario.

    ``scenario_id``: stable string id (stream order and splits refer to it).
    ``system_prompt``: the defender's rules. ``user_turns``: attacker messages, in
    order, at most the environment's T. ``verifier``: see :class:`Verifier`.
    ``meta``: free-form provenance (rule families, source line, ...).
    """

    scenario_id: str
    system_prompt: str
    user_turns: tuple[str, ...]
    verifier: Verifier
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not isinstance(self.scenario_id, str) or not self.scenario_id:
            raise ValueError(f"scenario_id must be a non-empty str, got {self.scenario_id!r}")
        if not isinstance(self.system_prompt, str):
            raise ValueError(f"scenario {self.scenario_id}: system_prompt must be a str")
        if not self.user_turns or not all(isinstance(u, str) for u in self.user_turns):
            raise ValueError(f"scenario {self.scenario_id}: user_turns must be a non-empty sequence of str")
        if not callable(self.verifier):
            raise ValueError(f"scenario {self.scenario_id}: verifier must be callable")

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)

    def grade(self, response: str, turn: int, think_opened_in_prompt: bool = False) -> Grade:
        """Grade the assistant reply to user turn ``turn`` (0-based) against all rules."""
        if not 0 <= turn < self.num_turns:
            raise ValueError(f"scenario {self.scenario_id}: turn must be in [0, {self.num_turns}), got {turn}")
        return grade_response(self.verifier, response, user_context(self.user_turns, turn), think_opened_in_prompt)

    def messages(self, turn: int, replies: Sequence[str], system_prompt: str | None = None) -> list[dict]:
        """Chat messages that prompt the reply to ``turn``: system, then user/assistant alternating.

        ``replies`` are the assistant replies to turns ``0..turn-1`` (visible or raw,
        as the caller keeps them). ``system_prompt`` overrides the scenario's (the
        ICL baseline passes its augmented prompt here).
        """
        if len(replies) != turn:
            raise ValueError(f"messages(turn={turn}) needs exactly {turn} earlier replies, got {len(replies)}")
        msgs = [{"role": "system", "content": self.system_prompt if system_prompt is None else system_prompt}]
        for t in range(turn):
            msgs.append({"role": "user", "content": self.user_turns[t]})
            msgs.append({"role": "assistant", "content": replies[t]})
        msgs.append({"role": "user", "content": self.user_turns[turn]})
        return msgs

