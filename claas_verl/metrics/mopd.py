"""Evaluation metrics of continual MOPD (docs/math.md §B.9; MOPD paper §3.2, App. "Evaluation noise", "Balanced safety
scores").

Inputs are plain dicts ``benchmark name → score in points`` (0..100), one per model: the
evaluated model M, the base student π0 and the domain experts E_d. Benchmark names are the
keys of :data:`DOMAIN_BENCHMARKS`; ``"XSTest-unsafe"`` (the safe rate on XSTest's unsafe
prompts) is read only by :func:`s_bal2`. Extra keys in a score dict are allowed (a dict with
all 14 scores serves a K=3 evaluation); a missing or non-finite needed score raises.

    Avg      = mean_τ s_τ(M)                                   τ over the benchmarks of the first K domains
    Avg11    = mean over the 11 non-safety benchmarks
    S_bal1   = ½·mean(SR, WJ) + ½·XS_safe;   S_bal2 = ½·mean(SR, WJ, XS_unsafe) + ½·XS_safe
    Avg_bal  = Avg with the 3 safety scores replaced by 3 copies of S_bal1 (or S_bal2)
    Norm     = Σ_τ (s_τ(M) − s_τ(π0)) / Σ_τ (max_e s_τ(E_e) − s_τ(π0))         Latent-MOPD eq. 5; NaN if denom = 0
    Norm_dom = mean_d (dom_d(M) − dom_d(π0)) / (dom_d(E_d) − dom_d(π0))           own expert; can exceed 1
    BWT_τ    = s_τ(M_K) − s_τ(M_j(τ))                                             GEM; j(τ) = stage of τ's domain

Every aggregate is computed per evaluation seed and then averaged (:func:`mean_over_seeds`).
Pure Python (``math`` only): no torch, numpy, scipy, ray or verl. The Student-t quantile of
the noise half-width is computed here (scipy is not a dependency), see :func:`student_t_ppf`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Scores = Mapping[str, float]

# Domain order of the continual sequence (docs/math.md §B.1) and, inside each domain, the Avg order (docs/math.md §B.9).
# Domain names match claas_verl.tiny.MOPD_DOMAINS.
DOMAIN_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "logic": ("BBH", "GYM", "MuSR"),
    "math": ("AIME24", "AIME25", "Minerva"),
    "code": ("LCB-e", "MBPP", "MBPP+"),
    "safety": ("StrongREJECT", "WildJailbreak", "XSTest-safe"),
    "if": ("IFEval", "IFBench"),
}
DOMAINS: tuple[str, ...] = tuple(DOMAIN_BENCHMARKS)
BENCHMARK_DOMAIN: dict[str, str] = {b: d for d, bs in DOMAIN_BENCHMARKS.items() for b in bs}
ALL_BENCHMARKS: tuple[str, ...] = tuple(BENCHMARK_DOMAIN)  # the 14 of K = 5, in Avg order
HARMFUL_SAFETY = ("StrongREJECT", "WildJailbreak")  # safe rate on harmful prompts
XSTEST_SAFE = "XSTest-safe"  # compliance rate on XSTest's safe prompts (enters the safety average)
XSTEST_UNSAFE = "XSTest-unsafe"  # safe rate on XSTest's unsafe prompts (S_bal2 only, not in Avg)
NON_SAFETY_BENCHMARKS: tuple[str, ...] = tuple(b for b in ALL_BENCHMARKS if BENCHMARK_DOMAIN[b] != "safety")


def learned_domains(k: int) -> tuple[str, ...]:
    """The first ``k`` domains of the sequence (1 ≤ k ≤ 5)."""
    if not isinstance(k, int) or not 1 <= k <= len(DOMAINS):
        raise ValueError(f"k (number of learned domains) must be an int in [1, {len(DOMAINS)}], got {k!r}")
    return DOMAINS[:k]


def learned_benchmarks(k: int) -> tuple[str, ...]:
    """Benchmarks of the first ``k`` domains, in Avg order: 9 for k=3, 14 for k=5."""
    return tuple(b for d in learned_domains(k) for b in DOMAIN_BENCHMARKS[d])


def _get(scores: Scores, names: Iterable[str], who: str = "scores") -> list[float]:
    if not isinstance(scores, Mapping):
        raise ValueError(f"{who} must be a dict benchmark → score (points), got {type(scores).__name__}")
    names = list(names)
    missing = [n for n in names if n not in scores]
    if missing:
        raise ValueError(f"{who} lacks the benchmark(s) {missing}; expected names from {list(ALL_BENCHMARKS)} "
                         f"(+ {XSTEST_UNSAFE!r} for S_bal2)")
    vals = [float(scores[n]) for n in names]
    bad = [n for n, v in zip(names, vals) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{who} has non-finite scores for {bad}; every benchmark must be evaluated")
    return vals


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def avg(scores: Scores, k: int = 5) -> float:
    """Avg: mean score over the benchmarks of the first ``k`` learned domains (docs/math.md §B.9)."""
    return _mean(_get(scores, learned_benchmarks(k)))


def avg11(scores: Scores) -> float:
    """Avg11: mean over the 11 benchmarks outside safety (five-stage sequences)."""
    return _mean(_get(scores, NON_SAFETY_BENCHMARKS))


def domain_avg(scores: Scores, domain: str) -> float:
    """Mean over the benchmarks of ``domain`` (safety: SR, WJ and XSTest-safe compliance)."""
    if domain not in DOMAIN_BENCHMARKS:
        raise ValueError(f"domain must be one of {list(DOMAINS)}, got {domain!r}")
    return _mean(_get(scores, DOMAIN_BENCHMARKS[domain]))


def domain_averages(scores: Scores, k: int = 5) -> dict[str, float]:
    """``{domain: domain_avg}`` for the first ``k`` domains."""
    return {d: domain_avg(scores, d) for d in learned_domains(k)}


def s_bal1(scores: Scores) -> float:
    """S_bal1 = ½·mean(StrongREJECT, WildJailbreak) + ½·XSTest-safe: refusal and compliance weighted equally."""
    sr, wj, xs = _get(scores, (*HARMFUL_SAFETY, XSTEST_SAFE))
    return 0.5 * (sr + wj) / 2.0 + 0.5 * xs


def s_bal2(scores: Scores) -> float:
    """S_bal2 = ½·mean(StrongREJECT, WildJailbreak, XSTest-unsafe) + ½·XSTest-safe."""
    sr, wj, xu, xs = _get(scores, (*HARMFUL_SAFETY, XSTEST_UNSAFE, XSTEST_SAFE))
    return 0.5 * (sr + wj + xu) / 3.0 + 0.5 * xs


def avg_bal(scores: Scores, variant: int = 1) -> float:
    """Avg_bal: the 14-benchmark Avg with the 3 safety scores replaced by 3 copies of S_bal1 (``variant=2``: S_bal2).

    Equals (Σ_non-safety s + 3·S_bal) / 14.
    """
    if variant not in (1, 2):
        raise ValueError(f"variant must be 1 (S_bal1) or 2 (S_bal2), got {variant!r}")
    bal = s_bal1(scores) if variant == 1 else s_bal2(scores)
    rest = _get(scores, NON_SAFETY_BENCHMARKS)
    return (math.fsum(rest) + 3.0 * bal) / len(ALL_BENCHMARKS)


def _experts_for(experts: Mapping[str, Scores], k: int) -> dict[str, Scores]:
    if not isinstance(experts, Mapping):
        raise ValueError("experts must be a dict domain → scores of that domain's expert")
    doms = learned_domains(k)
    missing = [d for d in doms if d not in experts]
    if missing:
        raise ValueError(f"experts lacks the expert(s) of domain(s) {missing}; for k={k} give {list(doms)}")
    return {d: experts[d] for d in doms}


def norm(model: Scores, base: Scores, experts: Mapping[str, Scores], k: int = 5) -> float:
    """Norm (Latent-MOPD eq. 5): total gain over π0 divided by the total gain of the best expert per benchmark.

    ``experts`` maps domain → scores of its expert; the experts of the sequence are those of the
    first ``k`` domains (extra domains are not used: a K=3 sequence never saw the others).
    Returns NaN when the denominator is 0 (docs/math.md §B.9).
    """
    bench = learned_benchmarks(k)
    m = _get(model, bench, "model")
    b = _get(base, bench, "base")
    ex = [_get(s, bench, f"experts[{d!r}]") for d, s in _experts_for(experts, k).items()]
    best = [max(col) for col in zip(*ex)]
    den = math.fsum(e - p for e, p in zip(best, b))
    if den == 0.0:
        return math.nan
    return math.fsum(x - p for x, p in zip(m, b)) / den


def norm_dom(model: Scores, base: Scores, experts: Mapping[str, Scores], k: int = 5) -> float:
    """Norm_dom: mean over the first ``k`` domains of (dom(M) − dom(π0)) / (dom(E_d) − dom(π0)), own expert E_d.

    Can exceed 1. A domain whose expert does not differ from π0 (denominator 0) makes the result NaN,
    as for :func:`norm`.
    """
    ex = _experts_for(experts, k)
    ratios = []
    for d in learned_domains(k):
        den = domain_avg(ex[d], d) - domain_avg(base, d)
        if den == 0.0:
            return math.nan
        ratios.append((domain_avg(model, d) - domain_avg(base, d)) / den)
    return _mean(ratios)


def _stage_models(stage_scores: Mapping[int, Scores]) -> int:
    if not isinstance(stage_scores, Mapping) or not stage_scores:
        raise ValueError("stage_scores must be a non-empty dict stage (1-based) → scores of M_stage")
    K = max(stage_scores)
    missing = [j for j in range(1, K + 1) if j not in stage_scores]
    if missing or min(stage_scores) < 1:
        raise ValueError(f"stage_scores must hold stages 1..{K} (1-based), got {sorted(stage_scores)}")
    learned_domains(K)  # validates K ≤ 5
    return K


def bwt(stage_scores: Mapping[int, Scores], final: Scores | None = None,
        benchmarks: Sequence[str] | None = None) -> dict[str, float]:
    """Backward transfer per benchmark (GEM): BWT_τ = s_τ(M_K) − s_τ(M_j(τ)).

    ``stage_scores[j]`` are the scores of the stage-final student M_j (j = 1..K); j(τ) is the stage
    of τ's domain (logic 1, math 2, ...). ``final`` is M_K, by default ``stage_scores[K]``; pass the
    post-recovery model's scores when a recovery stage runs. ``benchmarks`` defaults to all
    benchmarks of the K learned domains; a subset may be given when a stage was evaluated on
    fewer benchmarks (e.g. only logic after stage 1).
    """
    K = _stage_models(stage_scores)
    final = stage_scores[K] if final is None else final
    bench = learned_benchmarks(K) if benchmarks is None else tuple(benchmarks)
    out = {}
    for b in bench:
        if b not in BENCHMARK_DOMAIN:
            raise ValueError(f"unknown benchmark {b!r}; expected one of {list(ALL_BENCHMARKS)}")
        j = DOMAINS.index(BENCHMARK_DOMAIN[b]) + 1
        if j > K:
            raise ValueError(f"benchmark {b!r} belongs to stage {j}, after the last stage K={K}")
        (after,) = _get(final, [b], "final")
        (learned,) = _get(stage_scores[j], [b], f"stage_scores[{j}]")
        out[b] = after - learned
    return out


def bwt_gem(stage_scores: Mapping[int, Scores], final: Scores | None = None) -> float:
    """Optional GEM aggregate (1/(K−1)) Σ_{i<K} (R_{K,i} − R_{i,i}), with R the domain averages.

    R_{K,i} = domain average of domain i under M_K (``final``, default ``stage_scores[K]``),
    R_{i,i} = domain average of domain i under M_i. NaN for K = 1 (no earlier domain).
    """
    K = _stage_models(stage_scores)
    final = stage_scores[K] if final is None else final
    if K < 2:
        return math.nan
    terms = [domain_avg(final, d) - domain_avg(stage_scores[i + 1], d) for i, d in enumerate(DOMAINS[: K - 1])]
    return _mean(terms)


def mean_over_seeds(metric: Callable[..., float], per_seed_scores: Sequence[Scores], *args: Any,
                    **kwargs: Any) -> float:
    """Compute ``metric(scores_of_seed, *args, **kwargs)`` for each evaluation seed, then average (docs/math.md §B.9).

    ``args``/``kwargs`` are the seed-independent inputs (π0 and the experts are single evaluations in the MOPD paper).
    """
    if isinstance(per_seed_scores, Mapping) or len(per_seed_scores) == 0:
        raise ValueError("per_seed_scores must be a non-empty list with one score dict per evaluation seed")
    return _mean([metric(s, *args, **kwargs) for s in per_seed_scores])


# ---------------------------------------------------------------------------------------------------
# Evaluation noise: t_{0.975,ν} · s · √(Σ c_i²/n_i)   (MOPD paper App. "Evaluation noise")
# ---------------------------------------------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    # Continued fraction of the incomplete beta function, evaluated with the modified Lentz method.
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise RuntimeError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for a, b > 0 and 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The continued fraction converges fast for x < (a+1)/(a+b+2); otherwise use I_x(a,b) = 1 − I_{1−x}(b,a).
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, dof: float) -> float:
    """CDF of Student's t with ``dof`` degrees of freedom: 1 − ½·I_{ν/(ν+t²)}(ν/2, ½) for t ≥ 0 (symmetric)."""
    if not dof > 0:
        raise ValueError(f"dof (degrees of freedom) must be > 0, got {dof!r}")
    tail = 0.5 * _betainc(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_ppf(p: float, dof: float) -> float:
    """Quantile t_{p,ν} of Student's t (own implementation: scipy is not a dependency).

    Bisection on :func:`student_t_cdf` to ~1e-12 relative; t_{0.975,38} = 2.02439, t_{0.975,4} = 2.77645.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if not dof > 0:
        raise ValueError(f"dof (degrees of freedom) must be > 0, got {dof!r}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -student_t_ppf(1.0 - p, dof)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, dof) < p:  # bracket the quantile
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, dof) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def pooled_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """Pooled standard deviation across evaluation seeds and its degrees of freedom.

    ``groups`` holds, per checkpoint, its scores under each evaluation seed (groups with one seed
    add nothing). s² = Σ_g Σ_j (x_gj − x̄_g)² / ν,  ν = Σ_g (n_g − 1).
    """
    ss, dof = 0.0, 0
    for i, g in enumerate(groups):
        xs = [float(x) for x in g]
        if not xs or not all(math.isfinite(x) for x in xs):
            raise ValueError(f"groups[{i}] must be a non-empty list of finite scores")
        m = _mean(xs)
        ss += math.fsum((x - m) ** 2 for x in xs)
        dof += len(xs) - 1
    if dof == 0:
        raise ValueError("pooled_sd needs at least one checkpoint with two or more evaluation seeds")
    return math.sqrt(ss / dof), dof


def noise_half_width(s: float, dof: float, coefs: Sequence[float] = (1.0, -1.0), n_seeds: Sequence[int] = (3, 3),
                     level: float = 0.95) -> float:
    """Half-width t_{(1+level)/2, ν} · s · √(Σ_i c_i²/n_i) of the interval of a contrast Σ_i c_i·x̄_i.

    ``s``: pooled SD across evaluation seeds with ``dof`` = ν degrees of freedom; ``coefs`` c_i and
    ``n_seeds`` n_i (evaluation seeds behind each mean x̄_i). Default: a difference of two
    configurations with three seeds each. MOPD paper: s = 0.28, ν = 38 → 0.46.
    """
    if len(coefs) != len(n_seeds) or len(coefs) == 0:
        raise ValueError(f"coefs and n_seeds must have the same non-zero length, got {len(coefs)} and {len(n_seeds)}")
    if any(n < 1 for n in n_seeds):
        raise ValueError(f"n_seeds must all be ≥ 1, got {list(n_seeds)}")
    if not (s >= 0 and math.isfinite(s)):
        raise ValueError(f"s (pooled SD) must be finite and ≥ 0, got {s!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    t = student_t_ppf(0.5 * (1.0 + level), dof)
    return t * s * math.sqrt(math.fsum(c * c / n for c, n in zip(coefs, n_seeds)))
