"""Answer extraction shared by the scorers: pure string functions (MOPD paper App. C, "Evaluation details" and
"Truncation and answer extraction").

* :func:`split_thinking` — the answer after the thinking block; the whole response when the reasoning
  never closes (MOPD paper: safety judging, code extraction, IFEval/IFBench verification).
* :func:`last_boxed` — the last ``\\boxed{...}`` of the whole response, thinking included (BBH, GYM, math:
  MOPD paper scores "the last boxed answer"; a box drafted inside the thinking counts only when no later box exists).
* :func:`musr_choice` — MuSR's reading: the last line containing ``answer:`` (any case) in the whole response,
  thinking included; when there is no such line or it names no option, a random option drawn with a fixed
  seed (MOPD paper departs here from lm-eval's log-likelihood MuSR task).
* :func:`lenient_answer` — the MOPD paper's alternative reading (last ``<answer>`` tag or ``Answer:`` line), reported
  beside the official score, never instead of it.
"""

from __future__ import annotations

import random
import re

THINK_END = "</think>"


def split_thinking(response: str) -> tuple[str, bool]:
    """(text after the last ``</think>``, True) or (the whole response, False) when the reasoning never closes."""
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1].strip(), True
    return response.strip(), False


def _boxed_spans(text: str) -> list[str]:
    out, i = [], 0
    pat = re.compile(r"\\(?:boxed|fbox)\s*\{")
    while True:
        m = pat.search(text, i)
        if not m:
            return out
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:  # unbalanced (truncated inside the box): no answer from this box
            return out
        out.append(text[m.end(): j - 1])
        i = j


def last_boxed(response: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in the whole response, else None."""
    spans = _boxed_spans(response)
    return spans[-1].strip() if spans else None


_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\{(.*)\}$", re.S)


def unwrap_latex(ans: str) -> str:
    """Strip ``$``, ``\\text{..}``-style wrappers and surrounding white space from a boxed answer."""
    s = ans.strip().strip("$").strip()
    while True:
        m = _TEXT_WRAP.match(s)
        if not m:
            return s
        s = m.group(1).strip()


def lenient_answer(response: str) -> str | None:
    """the MOPD paper's alternative reading for BBH/GYM: last boxed answer, else last ``<answer>..</answer>``, else the
    text after the last ``Answer:`` (any case) on its line."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    tags = re.findall(r"<answer>(.*?)</answer>", response, flags=re.S | re.I)
    if tags:
        return tags[-1].strip()
    lines = re.findall(r"answer\s*:\s*(.+)", response, flags=re.I)
    return lines[-1].strip() if lines else None


def musr_choice(response: str, choices: list[str], fallback_seed: int) -> tuple[int, bool]:
    """(0-based option index, True) read from the last line containing ``answer:``, or (random option, False).

    The line may name the option by its number (1-based, as the prompt lists them) or by its text. The
    fallback draws from ``random.Random(fallback_seed)``, so the same item and sample always get the same option.
    """
    if not choices:
        raise ValueError("musr_choice: the item has no choices")
    lines = [ln for ln in response.splitlines() if "answer:" in ln.lower()]
    if lines:
        tail = lines[-1][lines[-1].lower().rindex("answer:") + len("answer:"):].strip().lower()
        m = re.search(r"\d+", tail)
        if m and 1 <= int(m.group()) <= len(choices):
            return int(m.group()) - 1, True
        named = [i for i, c in enumerate(choices) if c.strip() and c.strip().lower() in tail]
        if len(named) == 1:
            return named[0], True
    return random.Random(fallback_seed).randrange(len(choices)), False


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def last_code_block(text: str) -> str | None:
    """Body of the last fenced code block (any language tag) in ``text``, else None."""
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else None
