"""MOPD metrics (docs/math.md §B.9) against the numbers MOPD paper prints.

Per-benchmark scores are typed from the MOPD paper's "Full results" tables (five stages: two tables,
BBH..MBPP+ and StrongREJECT..IFBench; three-stage prefix: BBH..MBPP+); the expected aggregates
are the rows of the MOPD paper's Table 3 / the three-stage table, as listed in docs/math.md §B.9.
"""

import math

import pytest

from claas_verl.metrics.mopd import (
    ALL_BENCHMARKS,
    DOMAIN_BENCHMARKS,
    NON_SAFETY_BENCHMARKS,
    avg,
    avg11,
    avg_bal,
    bwt,
    bwt_gem,
    domain_averages,
    learned_benchmarks,
    mean_over_seeds,
    noise_half_width,
    norm,
    norm_dom,
    pooled_sd,
    s_bal1,
    s_bal2,
    student_t_cdf,
    student_t_ppf,
)

NINE = ALL_BENCHMARKS[:9]
SAFETY_IF = ("StrongREJECT", "WildJailbreak", "XSTest-safe", "XSTest-unsafe", "IFEval", "IFBench")


def row(first9, last6):
    """MOPD paper prints BBH GYM MuSR AIME24 AIME25 Minerva LCB-e MBPP MBPP+ | SR WJ XS-safe XS-unsafe IFEval
    IFBench."""
    return {**dict(zip(NINE, first9)), **dict(zip(SAFETY_IF, last6))}


STUDENT = row([38.89, 22.60, 39.68, 26.25, 23.96, 28.31, 52.99, 57.41, 48.02], [12.86, 14.40, 89.40, 24.2, 36.04, 9.33])
EXPERTS = {
    "logic": row([64.17, 43.83, 46.43, 52.29, 35.21, 34.01, 76.87, 56.35, 45.90],
                 [22.92, 23.80, 95.40, 45.2, 68.11, 19.25]),
    "math": row([44.35, 28.50, 45.77, 51.04, 37.92, 33.36, 64.93, 65.08, 55.16],
                [18.93, 14.40, 97.90, 34.0, 41.64, 12.50]),
    "code": row([39.72, 24.12, 45.24, 41.04, 28.12, 30.51, 73.51, 69.44, 57.41],
                [16.37, 16.50, 94.20, 30.2, 41.77, 10.33]),
    "safety": row([25.83, 20.00, 43.12, 26.88, 22.71, 28.12, 48.13, 56.48, 47.49],
                  [94.89, 67.90, 25.20, 98.0, 23.29, 9.08]),
    "if": row([40.56, 23.27, 40.21, 30.21, 23.96, 28.68, 55.60, 60.19, 50.40],
              [17.81, 12.00, 93.40, 33.5, 55.50, 14.08]),
}
SEQ = row([53.43, 32.47, 42.20, 38.82, 28.61, 30.55, 61.44, 66.27, 55.78], [12.17, 11.00, 94.73, 28.4, 55.62, 17.06])
FSAR = row([59.07, 37.56, 46.03, 46.94, 33.75, 33.82, 69.78, 70.72, 59.13], [90.10, 40.37, 26.33, 96.9, 54.28, 16.81])
TIES5 = row([65.40, 43.99, 48.32, 54.58, 37.64, 35.72, 76.24, 69.58, 58.33], [58.63, 19.13, 86.10, 75.0, 61.37, 16.97])
# Three-stage prefix, Seq after stage 3 (table "Three-stage prefix"; student/expert rows are the same evaluations).
SEQ3 = dict(zip(NINE, [60.31, 30.55, 39.33, 45.49, 32.85, 33.49, 68.91, 70.86, 60.14]))


def r2(x):
    return round(x + 1e-9, 2)  # printed to 2 decimals; +1e-9 so an exact .xx5 in real arithmetic rounds up


def test_domain_maps_and_learned_sets():
    assert DOMAIN_BENCHMARKS["safety"] == ("StrongREJECT", "WildJailbreak", "XSTest-safe")
    assert len(learned_benchmarks(5)) == 14 and len(learned_benchmarks(3)) == 9
    assert learned_benchmarks(3) == ("BBH", "GYM", "MuSR", "AIME24", "AIME25", "Minerva", "LCB-e", "MBPP", "MBPP+")
    assert len(NON_SAFETY_BENCHMARKS) == 11 and "XSTest-safe" not in NON_SAFETY_BENCHMARKS


def test_student_reference():
    # Avg = 500.13/14 = 35.7236; Avg11 = 383.47/11 = 34.8618
    assert r2(avg(STUDENT)) == 35.72 and r2(avg11(STUDENT)) == 34.86
    # S_bal1 = ½·(12.86+14.40)/2 + ½·89.40 = 6.815 + 44.70 = 51.515 exactly (docs/math.md §B.9: 51.52; the paper prints
    # 51.51)
    assert s_bal1(STUDENT) == pytest.approx(51.515, abs=1e-12)
    # Avg_bal = (383.47 + 3·51.515)/14 = 538.015/14 = 38.4296
    assert r2(avg_bal(STUDENT)) == 38.43
    # S_bal2 = ½·(12.86+14.40+24.2)/3 + ½·89.40 = 8.5767 + 44.70 = 53.2767 (MOPD paper table 16: 53.28); Avg with it
    # 38.81
    assert r2(s_bal2(STUDENT)) == 53.28 and r2(avg_bal(STUDENT, variant=2)) == 38.81
    assert norm(STUDENT, STUDENT, EXPERTS) == 0.0 and norm_dom(STUDENT, STUDENT, EXPERTS) == 0.0


@pytest.mark.parametrize("scores, expected", [
    (SEQ, (42.87, 43.84, 45.84, 0.303, 0.539)),
    (FSAR, (48.91, 47.99, 47.52, 0.559, 0.842)),
    (TIES5, (52.29, 51.65, 53.97, 0.702, 1.061)),
])
def test_five_stage_rows(scores, expected):
    got = (r2(avg(scores)), r2(avg11(scores)), r2(avg_bal(scores)),
           round(norm(scores, STUDENT, EXPERTS), 3), round(norm_dom(scores, STUDENT, EXPERTS), 3))
    assert got == expected


@pytest.mark.parametrize("domain, expected", [  # MOPD paper Table 3 expert rows: Avg, Norm, Norm_dom
    ("logic", (48.90, 0.558, 0.913)), ("math", (43.68, 0.337, 0.506)), ("code", (42.02, 0.267, 0.411)),
    ("safety", (38.51, 0.118, 0.013)), ("if", (38.99, 0.138, 0.286)),
])
def test_expert_rows(domain, expected):
    e = EXPERTS[domain]
    assert (r2(avg(e)), round(norm(e, STUDENT, EXPERTS), 3), round(norm_dom(e, STUDENT, EXPERTS), 3)) == expected


def test_domain_averages_seq():
    # MOPD paper Table 3 Seq: logic 42.70, math 32.66, code 61.16, safety 39.30 (SR, WJ, XS-safe), IF 36.34
    assert {d: r2(v) for d, v in domain_averages(SEQ).items()} == {
        "logic": 42.70, "math": 32.66, "code": 61.16, "safety": 39.30, "if": 36.34}


def test_three_stage_seq():
    # Avg over 9 = 49.10; Norm over the first three experts 0.720; Norm_dom 0.765 (MOPD paper three-stage tables)
    assert r2(avg(SEQ3, k=3)) == 49.10
    assert round(norm(SEQ3, STUDENT, EXPERTS, k=3), 3) == 0.720
    assert round(norm_dom(SEQ3, STUDENT, EXPERTS, k=3), 3) == 0.765
    # SEQ3 has no safety/IF scores: a five-domain metric must say which are missing
    with pytest.raises(ValueError, match="StrongREJECT"):
        avg(SEQ3)


def test_norm_uses_only_the_sequence_experts():
    # K=3: the safety expert's MuSR (43.12) must not enter even if it were the best; make it huge to check
    experts = {**EXPERTS, "safety": {**EXPERTS["safety"], "MuSR": 99.0}}
    assert norm(SEQ3, STUDENT, experts, k=3) == norm(SEQ3, STUDENT, EXPERTS, k=3)
    with pytest.raises(ValueError, match="code"):
        norm(SEQ3, STUDENT, {"logic": EXPERTS["logic"], "math": EXPERTS["math"]}, k=3)


def test_norm_nan_when_no_headroom():
    assert math.isnan(norm(SEQ, STUDENT, {d: STUDENT for d in EXPERTS}))
    assert math.isnan(norm_dom(SEQ, STUDENT, {d: STUDENT for d in EXPERTS}))


# Seq after each stage (MOPD paper "Scores after each stage"): stage 1 logic, stage 2 logic + math, stage 3 = SEQ3.
SEQ_STAGE1 = {"BBH": 54.14, "GYM": 34.25, "MuSR": 46.74}
SEQ_STAGE2 = {"BBH": 63.15, "GYM": 43.24, "MuSR": 35.58, "AIME24": 42.08, "AIME25": 33.40, "Minerva": 34.41}


def test_bwt_seq_three_stages():
    stages = {1: SEQ_STAGE1, 2: SEQ_STAGE2, 3: SEQ3}
    got = bwt(stages, benchmarks=learned_benchmarks(2))
    assert got["MuSR"] == pytest.approx(39.33 - 46.74) and r2(got["MuSR"]) == -7.41  # docs/math.md §B.9 check
    assert r2(got["BBH"]) == 6.17 and r2(got["Minerva"]) == -0.92  # MOPD paper table: +6.17, −0.92
    # GYM, AIME24, AIME25: MOPD paper prints −3.69, +3.40, −0.56 from per-seed values; the means give −3.70, +3.41,
    # −0.55
    for b, printed in (("GYM", -3.69), ("AIME24", 3.40), ("AIME25", -0.56)):
        assert got[b] == pytest.approx(printed, abs=0.0101)
    # Code is learned at stage 3 = K: BWT is 0 without recovery, s(recovered) − s(M_3) with it
    assert bwt(stages)["MBPP"] == 0.0
    assert bwt(stages, final={**SEQ3, "MBPP": 71.86}, benchmarks=["MBPP"])["MBPP"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="stage_scores\\[1\\] lacks the benchmark\\(s\\) \\['MuSR'\\]"):
        bwt({**stages, 1: {"BBH": 54.14, "GYM": 34.25}})
    with pytest.raises(ValueError, match="stages 1..3"):
        bwt({1: SEQ_STAGE1, 3: SEQ3})


def test_bwt_gem_aggregate():
    # R_{3,logic} = (60.31+30.55+39.33)/3 = 43.3967, R_{1,logic} = (54.14+34.25+46.74)/3 = 45.0433
    # R_{3,math} = (45.49+32.85+33.49)/3 = 37.2767,  R_{2,math} = (42.08+33.40+34.41)/3 = 36.6300
    # GEM = ((43.3967−45.0433) + (37.2767−36.63)) / 2 = (−1.6467 + 0.6467)/2 = −0.5000
    assert bwt_gem({1: SEQ_STAGE1, 2: SEQ_STAGE2, 3: SEQ3}) == pytest.approx(-0.5, abs=1e-12)
    assert math.isnan(bwt_gem({1: SEQ_STAGE1}))


def test_mean_over_seeds():
    # Three seeds whose scores are SEQ shifted by −0.21, +0.12, +0.09 everywhere: per-seed Avg 42.66, 42.99, 42.96
    seeds = [{k: v + dlt for k, v in SEQ.items()} for dlt in (-0.21, 0.12, 0.09)]
    assert mean_over_seeds(avg, seeds) == pytest.approx(avg(SEQ))
    assert mean_over_seeds(norm, seeds, STUDENT, EXPERTS) == pytest.approx(norm(SEQ, STUDENT, EXPERTS))
    with pytest.raises(ValueError, match="per_seed_scores"):
        mean_over_seeds(avg, SEQ)


def test_student_t():
    # exact closed forms: ν=1 Cauchy F(t) = ½ + atan(t)/π; ν=2 F(t) = ½ + t/(2√(2+t²))
    for t in (-3.0, -0.4, 0.0, 0.7, 5.0):
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    assert student_t_ppf(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-10)  # 12.7062
    assert student_t_ppf(0.975, 2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95 ** 2)), rel=1e-10)  # 4.3027
    # tabulated t_{0.975,ν}: 4 → 2.7764, 26 → 2.0555, 38 → 2.0244; ν → ∞ → z = 1.959964
    assert student_t_ppf(0.975, 4) == pytest.approx(2.776445, abs=1e-6)
    assert student_t_ppf(0.975, 26) == pytest.approx(2.055529, abs=1e-6)
    assert student_t_ppf(0.975, 38) == pytest.approx(2.024394, abs=1e-6)
    assert student_t_ppf(0.975, 1e8) == pytest.approx(1.959964, abs=1e-6)
    assert student_t_ppf(0.025, 38) == -student_t_ppf(0.975, 38)


def test_noise_half_width_003():
    # MOPD paper: s=0.28, ν=38, 3 vs 3 seeds → 2.0244·0.28·√(2/3) = 0.4628 ("0.46"); 1 vs 1 → 0.8016 ("0.80")
    assert round(noise_half_width(0.28, 38), 2) == 0.46
    assert round(noise_half_width(0.28, 38, n_seeds=(1, 1)), 2) == 0.80
    # three-stage: s=0.32, ν=26 → 2.0555·0.32·0.8165 = 0.5371 ("0.54")
    assert round(noise_half_width(0.32, 26), 2) == 0.54
    with pytest.raises(ValueError, match="same non-zero length"):
        noise_half_width(0.28, 38, coefs=(1, -1), n_seeds=(3,))


def test_pooled_sd():
    # groups (1,2,3) and (5,7): SS = 2 + 2 = 4, ν = 2 + 1 = 3, s = √(4/3); a single-seed group adds nothing
    s, dof = pooled_sd([[1, 2, 3], [5, 7], [9]])
    assert dof == 3 and s == pytest.approx(math.sqrt(4 / 3))
    with pytest.raises(ValueError, match="two or more"):
        pooled_sd([[1.0], [2.0]])


def test_bad_inputs():
    with pytest.raises(ValueError, match="non-finite"):
        avg({**SEQ, "BBH": float("nan")})
    with pytest.raises(ValueError, match="XSTest-unsafe"):
        s_bal2({k: v for k, v in SEQ.items() if k != "XSTest-unsafe"})
    with pytest.raises(ValueError, match="k \\(number of learned domains\\)"):
        avg(SEQ, k=6)
    with pytest.raises(ValueError, match="variant"):
        avg_bal(SEQ, variant=3)
