"""Arithmetic of the continual benchmark (``benchmarks/continual.py``): per-run scores and their seed intervals.

Pure Python (no torch, ray or verl). One *run* is one method (recipe) under one seed; its ``stage_scores`` map
each evaluated stage end to the task accuracy of every domain learned so far::

    stage_scores = {1: {"spell": 0.9}, 2: {"spell": 0.4, "reverse": 0.8}, 3: {...}, 4: {...}}   # 4 = recovery

With ``order`` = the domains in stage order (domain d is learned in stage j(d) = its position + 1) and F the last
evaluated stage (the recovery stage when a run has one: docs/math.md §B.9 takes M_K after recovery):

    final_avg   = mean_d s_d(F)                                                  over every domain of ``order``
    BWT         = 1/(K−1) · Σ_{d ≠ last} ( s_d(F) − s_d(j(d)) )                  docs/math.md §B.9 (GEM aggregate)
    forgetting  = 1/(K−1) · Σ_{d ≠ last} ( max_{j(d) ≤ k < F} s_d(k) − s_d(F) )^+  (Chaudhry et al. 2018; ≥ 0)
    Norm        = Σ_d (s_d(F) − s_d(π0)) / Σ_d (max_e s_d(E_e) − s_d(π0))        docs/math.md §B.9 (Latent-MOPD eq. 5)
    gain_d      = s_d(j(d)) − s_d(π0)                what domain d's own stage taught (joint: s_d(F) − s_d(π0))

A run without stages (joint MOPD: one stage that teaches every domain) has no j(d): its BWT and forgetting are
``None``. Over seeds, every metric is reported as ``[mean, half_width]`` with the half-width of the 95% interval
of the mean, ``t_{0.975, n−1} · s / √n`` (docs/math.md §B.9's noise formula with one mean; ``None`` for n = 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from claas_verl.metrics.mopd import student_t_ppf

StageScores = Mapping[int, Mapping[str, float]]


def _stages(stage_scores: StageScores) -> list[int]:
    if not stage_scores:
        raise ValueError("stage_scores is empty: the run evaluated no stage end")
    return sorted(int(k) for k in stage_scores)


def _score(stage_scores: StageScores, stage: int, domain: str) -> float:
    row = stage_scores.get(stage, stage_scores.get(str(stage)))  # JSON keys are strings
    if row is None or domain not in row or row[domain] is None:
        raise ValueError(f"stage_scores[{stage}] has no score for domain {domain!r}; every stage end must "
                         "evaluate every domain learned so far")
    v = float(row[domain])
    if not math.isfinite(v):
        raise ValueError(f"stage_scores[{stage}][{domain!r}] = {v} is not finite")
    return v


def _norm_keys(stage_scores: StageScores) -> dict[int, Mapping[str, float]]:
    return {int(k): v for k, v in stage_scores.items()}


def final_scores(stage_scores: StageScores, order: Sequence[str]) -> dict[str, float]:
    """Scores of the last evaluated model on every domain of ``order``."""
    ss = _norm_keys(stage_scores)
    last = _stages(ss)[-1]
    return {d: _score(ss, last, d) for d in order}


def run_metrics(stage_scores: StageScores, order: Sequence[str], staged: bool = True,
                base: Mapping[str, float] | None = None,
                experts: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, float | None]:
    """``final_avg``, ``bwt``, ``forgetting`` and (with ``base`` and ``experts``) ``norm`` of one run.

    Args:
        stage_scores: {stage: {domain: score}}, stage 1-based (see the module docstring).
        order: domains in stage order.
        staged: False for joint MOPD (no per-domain learning stage: BWT and forgetting are None).
        base: π0's score per domain; experts: {expert name: {domain: score}} (Norm's denominator takes, per
            domain, the best expert).
    """
    if not order:
        raise ValueError("order must list at least one domain")
    ss = _norm_keys(stage_scores)
    stages = _stages(ss)
    last = stages[-1]
    if staged and last < len(order):
        raise ValueError(f"a staged run over {len(order)} domains must evaluate stage {len(order)}; "
                         f"the last evaluated stage is {last}")
    fin = final_scores(ss, order)
    out: dict[str, float | None] = {"final_avg": math.fsum(fin.values()) / len(order), "bwt": None,
                                    "forgetting": None, "norm": None}
    if staged and len(order) >= 2:
        earlier = list(order[:-1])
        bwt, forget = [], []
        for j, d in enumerate(earlier, start=1):
            bwt.append(fin[d] - _score(ss, j, d))
            best = max(_score(ss, k, d) for k in stages if j <= k < last)
            forget.append(max(best - fin[d], 0.0))
        out["bwt"] = math.fsum(bwt) / len(earlier)
        out["forgetting"] = math.fsum(forget) / len(earlier)
    if base is not None:
        gains = stage_gains(ss, order, base, staged=staged)
        out["stage_gain"] = gains
        out["min_stage_gain"] = min(gains.values())
    if base is not None and experts is not None:
        num = math.fsum(fin[d] - float(base[d]) for d in order)
        den = math.fsum(max(float(e[d]) for e in experts.values()) - float(base[d]) for d in order)
        out["norm"] = num / den if den != 0 else None
    return out


def stage_gains(stage_scores: StageScores, order: Sequence[str], base: Mapping[str, float],
                staged: bool = True) -> dict[str, float]:
    """What each domain's own stage taught: ``gain_d = s_d(j(d)) − s_d(π0)``, its score right after the stage that
    trains it minus π0's (joint MOPD, no stages: ``s_d(F) − s_d(π0)``). Forgetting says what later stages took
    away; this says whether there was anything to take."""
    ss = _norm_keys(stage_scores)
    last = _stages(ss)[-1]
    missing = [d for d in order if d not in base or base[d] is None]
    if missing:
        raise ValueError(f"π0's score is missing for {missing}: the gains are measured from π0")
    return {d: _score(ss, j if staged else last, d) - float(base[d]) for j, d in enumerate(order, start=1)}


def gain_summary(runs: Sequence[Mapping]) -> dict[str, dict[str, list[float | None]]]:
    """{recipe: {domain: [mean, half_width]}} of the runs' ``stage_gain`` over seeds (runs without it are skipped)."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for d, v in (r.get("stage_gain") or {}).items():
            acc.setdefault(str(r["recipe"]), {}).setdefault(d, []).append(float(v))
    return {recipe: {d: mean_half_width(vs) for d, vs in row.items()} for recipe, row in acc.items()}


def mean_half_width(values: Sequence[float | None], level: float = 0.95) -> list[float | None]:
    """``[mean, half_width]`` of the values that are not None: half_width = t_{(1+level)/2, n−1} · s / √n.

    ``[None, None]`` when no value is given, ``[mean, None]`` for a single value (no interval from one seed).
    """
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return [None, None]
    n = len(xs)
    m = math.fsum(xs) / n
    if n < 2:
        return [m, None]
    s = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    return [m, student_t_ppf(0.5 * (1.0 + level), n - 1) * s / math.sqrt(n)]


def summarize(runs: Sequence[Mapping],
              keys: Sequence[str] = ("final_avg", "forgetting", "bwt", "norm", "min_stage_gain")) -> dict:
    """{recipe: {key: [mean, half_width], "seeds": [...]}} over the runs of each recipe (in first-seen order)."""
    by: dict[str, list[Mapping]] = {}
    for r in runs:
        by.setdefault(str(r["recipe"]), []).append(r)
    out = {}
    for recipe, rs in by.items():
        row: dict = {"seeds": [r["seed"] for r in rs]}
        for k in keys:
            row[k] = mean_half_width([r.get(k) for r in rs])
        out[recipe] = row
    return out


def paired_differences(runs: Sequence[Mapping], baseline: str,
                       keys: Sequence[str] = ("final_avg", "forgetting")) -> dict:
    """{recipe: {key: [mean, half_width], "seeds": [...]}} of ``recipe − baseline`` per seed, over the seeds both
    ran (a run and its baseline share the seed's rollouts up to where the schedules part, e.g. the same stage-1
    student, so the paired interval is the one that tells two methods apart). The baseline itself is left out."""
    by: dict[str, dict[int, Mapping]] = {}
    for r in runs:
        by.setdefault(str(r["recipe"]), {})[int(r["seed"])] = r
    base = by.get(baseline, {})
    out = {}
    for recipe, seeds in by.items():
        common = sorted(set(seeds) & set(base))
        if recipe == baseline or not common:
            continue
        row: dict = {"seeds": common}
        for k in keys:
            diffs = [None if seeds[s].get(k) is None or base[s].get(k) is None else
                     float(seeds[s][k]) - float(base[s][k]) for s in common]
            row[k] = mean_half_width(diffs)
        out[recipe] = row
    return out


def mean_stage_scores(runs: Sequence[Mapping]) -> dict[int, dict[str, list[float | None]]]:
    """Per stage and domain, ``[mean, half_width]`` over the given runs' ``stage_scores`` (one recipe's seeds)."""
    cells: dict[int, dict[str, list[float]]] = {}
    for r in runs:
        for st, row in r["stage_scores"].items():
            for d, v in row.items():
                cells.setdefault(int(st), {}).setdefault(d, []).append(float(v))
    return {st: {d: mean_half_width(vs) for d, vs in row.items()} for st, row in sorted(cells.items())}
