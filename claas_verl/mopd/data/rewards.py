"""verl custom reward function for the prompt files of ``python -m claas_verl.mopd.data mopd`` (logged score only:
the MOPD loss uses no reward, docs/math.md §B.2).

Use from a recipe (verl loads this file by path)::

    reward.custom_reward_function.path=claas_verl/mopd/data/rewards.py

``compute_score(data_source, solution_str, ground_truth, extra_info)`` per ``data_source``:

* ``reasoning_gym/<task>``: the last ``<answer>`` tag (what the logic prompts ask for), or the whole reply when
  ``meta.answer_format`` is ``plain`` (the continual benchmark's tiny models), scored by the task's own
  reasoning-gym scorer on the entry rebuilt from ``extra_info.meta`` (task, config, size, seed, index);
* ``math_dapo``: verl's DAPO scorer (the "Answer:" line; 1 correct, -1 wrong);
* ``nvidia/OpenCodeReasoning``: OpenCodeReasoning has no tests, so only the format is scored: 1 when the answer
  after the thinking block holds a fenced code block;
* ``star1/refuse`` / ``star1/comply``: the refusal-keyword rule of the tiny safety domain (a heuristic; the
  evaluation judges safety with a guard model);
* ``ultradata/if``: lm-eval's IFEval verifiers (prompt-level strict) when the row carries IFEval instruction ids,
  else 0 (no verifiable constraint);
* ``claas_tiny/*`` and ``openai/gsm8k``: the rule rewards (:mod:`claas_verl.mopd.data.rule_rewards`), so one path
  serves tiny and paper recipes.
"""

from __future__ import annotations

import json
import re

_FENCE = re.compile(r"```[^\n]*\n.*?```", re.S)

# Optional modules (the ``eval`` extra) each data source's score imports, by data-source prefix: checked before
# Ray starts (claas_verl.mopd.data.extras), since inside the reward worker a missing one fails minutes into a run.
EXTRA_MODULES = {
    "reasoning_gym/": ("reasoning_gym",),
    "ultradata/if": ("lm_eval", "langdetect", "immutabledict"),
}


def extra_modules(data_source: str) -> tuple[str, ...]:
    """The optional modules scoring ``data_source`` imports (empty for the tiny, math, code and safety sources)."""
    return next((mods for prefix, mods in EXTRA_MODULES.items() if str(data_source).startswith(prefix)), ())


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[1] if "</think>" in text else text


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **_verl_kwargs) -> float:
    ds = str(data_source)
    if ds.startswith("claas_tiny/") or ds == "openai/gsm8k":
        from claas_verl.mopd.data.rule_rewards import compute_score as rule_score

        return rule_score(ds, solution_str, ground_truth, extra_info)
    if ds.startswith("reasoning_gym/"):
        from claas_verl.mopd.data.gym_score import score_reasoning_gym

        return score_reasoning_gym(_after_thinking(solution_str), extra_info)
    if ds == "math_dapo":
        from verl.utils.reward_score import default_compute_score

        out = default_compute_score(ds, solution_str, ground_truth, extra_info)
        return float(out["score"] if isinstance(out, dict) else out)
    if ds == "nvidia/OpenCodeReasoning":
        return float(bool(_FENCE.search(_after_thinking(solution_str))))
    if ds in ("star1/refuse", "star1/comply"):
        from claas_verl.mopd.data.rule_rewards import compute_score as rule_score

        return rule_score("claas_tiny/safety", _after_thinking(solution_str), ground_truth, extra_info)
    if ds == "ultradata/if":
        truth = json.loads(ground_truth) if ground_truth else {}
        if not truth.get("instruction_id_list"):
            return 0.0
        from claas_verl.mopd.eval.benchmarks import if_checker

        item = {"key": 0, "question": (extra_info or {}).get("prompt", ""),
                "instruction_id_list": list(truth["instruction_id_list"]),
                "kwargs": [{k: v for k, v in (kw or {}).items() if v is not None} for kw in truth.get("kwargs", [])]}
        try:
            return float(if_checker(None)(item, _after_thinking(solution_str).strip()))
        except KeyError as e:  # an instruction id lm-eval's IFEval does not know
            raise ValueError(f"ultradata/if: instruction id {e} is not an IFEval instruction") from e
    raise ValueError(f"data_source={ds!r} has no reward here; expected reasoning_gym/<task>, math_dapo, "
                     "nvidia/OpenCodeReasoning, star1/refuse|comply, ultradata/if, claas_tiny/* or openai/gsm8k")
