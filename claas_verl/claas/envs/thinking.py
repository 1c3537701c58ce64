"""Qwen-style thinking text handling before grading (docs/math.md §A.1.4, CLaaS paper (zh) App. A.3).

CLaaS paper (zh) A.3: "before grading, Qwen-style formatting is removed; if no closing tag is
output, the step fails directly". The grader therefore only ever sees the
*visible* answer, i.e. what follows the last ``</think>``.

Two chat-template conventions exist and both are handled:
- the response itself opens the block (``<think>…</think>answer``);
- the generation prompt already opened it (Qwen3 templates may end the prompt
  with ``<think>\\n``), so the response is ``…</think>answer``. Pass
  ``think_opened_in_prompt=True`` in that case: a response without ``</think>``
  then means the length limit cut the thinking off.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class VisibleText:
    """Result of :func:`strip_thinking`.

    ``text``: the visible answer, whitespace-stripped ("" when unclosed).
    ``unclosed``: a thinking block was opened and never closed (length exceeded).
    """

    text: str
    unclosed: bool


def strip_thinking(response: str, think_opened_in_prompt: bool = False) -> VisibleText:
    """Remove Qwen-style ``<think>…</think>`` text and report an unclosed block.

    The visible text is everything after the LAST ``</think>`` (a model may emit
    several blocks; anything before the final close is reasoning). Without any
    ``</think>``, the block is unclosed iff ``<think>`` occurs in the response or
    the prompt opened it.
    """
    if not isinstance(response, str):
        raise ValueError(f"response must be a str, got {type(response).__name__}")
    close = response.rfind(THINK_CLOSE)
    if close >= 0:
        return VisibleText(text=response[close + len(THINK_CLOSE):].strip(), unclosed=False)
    if think_opened_in_prompt or THINK_OPEN in response:
        return VisibleText(text="", unclosed=True)
    return VisibleText(text=response.strip(), unclosed=False)
