"""Grader callbacks: the reward of a served turn computed by the service itself (no ``/v1/feedback`` needed).

A grader is any callable ``grader(request: GradeRequest) -> Grade | float | (reward, feedback) | None``. It may be
slow (a sandboxed verifier) and is run in a worker thread. ``None`` or a :class:`~claas_verl.claas.envs.Grade` with
reward ``None`` means a grader error: the turn is dropped (docs/math.md §A.1.4); so is any exception the grader raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from claas_verl.claas.envs.base import Grade, Verifier, grade_response
from claas_verl.claas.service.templating import user_context


@dataclass(frozen=True)
class GradeRequest:
    """What a grader sees: the chat context, the raw response text (thinking included) and the request metadata."""

    messages: list[dict]
    response_text: str
    scenario_id: int
    step_idx: int | None
    metadata: dict = field(default_factory=dict)


Grader = Callable[[GradeRequest], Any]


def normalize_grade(result: Any) -> tuple[float | None, str | None]:
    """``Grade`` / number / ``(reward, feedback)`` / ``None`` -> ``(reward, feedback)``; ``ValueError`` otherwise."""
    if result is None:
        return None, None
    if isinstance(result, Grade):
        return result.reward, result.feedback
    if isinstance(result, tuple) and len(result) == 2:
        reward, feedback = result
    else:
        reward, feedback = result, None
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise ValueError(f"a grader must return a finite reward or None, got {reward!r}")
    if feedback is not None and not isinstance(feedback, str):
        raise ValueError(f"a grader's feedback must be a str or None, got {type(feedback).__name__}")
    return (None if reward is None else float(reward)), feedback


def verifier_grader(verifier: Verifier, think_opened_in_prompt: bool = False) -> Grader:
    """A grader from an environment verifier (``claas_verl.claas.envs``): strips thinking, grades the visible text
    against the concatenated user messages (CLaaS paper App.), and maps the verdict with ``grade_response``
    (docs/math.md §A.1.4 rewards)."""

    def grade(request: GradeRequest) -> Grade:
        return grade_response(verifier, request.response_text, user_context(request.messages), think_opened_in_prompt)

    return grade
