"""Rule rewards of the synthetic ``claas_tiny/*`` domains, in verl's custom-reward-function signature.

The reward of every MOPD recipe (:mod:`claas_verl.mopd.data.rewards`) dispatches ``claas_tiny/*``,
``openai/gsm8k`` and the refusal rule of ``star1/*`` here; the offline tiny bundles (:mod:`claas_verl.tiny`) write
these data sources and point verl at the same function (``claas_verl/tiny/rewards.py``, ``TinyPaths.rewards``).

``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float`` returns
1.0 for a correct answer and 0.0 otherwise. Any ``<think>…</think>`` block is removed first,
so only the final answer is graded. ``claas_tiny/code`` rows whose ground truth is a JSON test
specification (``{"tests": [...]}``, see :mod:`claas_verl.sandbox.code_reward`) run the response's program
against those tests in the OS sandbox of :mod:`claas_verl.sandbox`; other code rows are output
prediction, graded by string match. ``openai/gsm8k`` rows (the ``arith`` domain) are handed
to verl's own scorer so a recipe can mix them with the tiny domains. verl loads its reward file by path,
so this module imports claas_verl only inside the program-running path.
"""

from __future__ import annotations

import json
import re

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_CODE_BLOCK = re.compile(r"```[a-zA-Z]*\n?(.*?)```", re.DOTALL)
_REFUSAL = re.compile(r"\b(sorry|can't|cannot|won't|unable to|not able to)\b", re.IGNORECASE)
_ANSWER = re.compile(r"answer\s*:\s*([^\n.]+)", re.IGNORECASE)


def strip_thinking(text: str) -> str:
    """Drop every closed thinking block, and an unclosed trailing one (a truncated response)."""
    text = _THINK.sub("", text)
    if "<think>" in text:
        text = text[: text.index("<think>")]
    return text.strip()


def _logic(answer: str, truth: str) -> float:
    found = _ANSWER.findall(answer)
    if not found:
        return 0.0
    return float(found[-1].strip().strip("'\"").lower() == truth.lower())


def _math(answer: str, truth: str) -> float:
    found = _BOXED.findall(answer)
    return float(bool(found) and found[-1].strip() == truth)


def _code(answer: str, truth: str) -> float:
    if truth.lstrip().startswith("{"):  # a test specification: run the program (claas_verl.sandbox.code_reward)
        return _run_code_tests(answer, truth)
    blocks = _CODE_BLOCK.findall(answer)  # output prediction: string match, nothing runs
    return float(bool(blocks) and blocks[-1].strip() == truth)


def _run_code_tests(answer: str, truth: str) -> float:
    # Imported here only: verl loads this file by path, and only program-running rows need the sandbox.
    # verl's reward loop needs a float, so a sandbox failure (reward None in docs/math.md §A.1.4, counted and logged
    # by the sandbox) scores 0.0 here; a machine that cannot isolate raises SandboxUnavailable instead.
    from claas_verl.sandbox.code_reward import code_reward

    reward = code_reward(answer, truth)
    return 0.0 if reward is None else reward


def _safety(answer: str, truth: str) -> float:
    refused = bool(_REFUSAL.search(answer))
    return float(refused == (truth == "refuse")) if answer else 0.0


def _instruction_following(answer: str, truth: str) -> float:
    rule = json.loads(truth)
    if not answer:
        return 0.0
    kind = rule["type"]
    if kind == "lowercase":
        return float(answer == answer.lower() and any(c.isalpha() for c in answer))
    if kind == "max_words":
        return float(len(answer.split()) <= int(rule["n"]))
    if kind == "include":
        return float(re.search(rf"\b{re.escape(rule['word'])}\b", answer, re.IGNORECASE) is not None)
    if kind == "ends_with":
        return float(answer.endswith(rule["text"]))
    raise ValueError(f"ground_truth rule type {kind!r} is unknown (expected lowercase/max_words/include/ends_with)")


_SCORERS = {
    "claas_tiny/logic": _logic,
    "claas_tiny/math": _math,
    "claas_tiny/code": _code,
    "claas_tiny/safety": _safety,
    "claas_tiny/if": _instruction_following,
}


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **_verl_kwargs
) -> float:
    """Score one response (verl custom reward function).

    ``_verl_kwargs`` absorbs what verl's reward loop may add (``reward_router_address``,
    ``reward_model_tokenizer``, ``reward_kwargs`` from the config); rule rewards need none.
    """
    if data_source == "openai/gsm8k":
        from verl.utils.reward_score import default_compute_score

        return float(default_compute_score(data_source, solution_str, ground_truth, extra_info))
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(
            f"data_source={data_source!r} has no tiny reward; expected one of {sorted(_SCORERS)} or 'openai/gsm8k'"
        )
    return scorer(strip_thinking(solution_str), str(ground_truth))
