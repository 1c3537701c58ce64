"""The continual benchmark's own arithmetic (claas_verl.metrics.benchmark) on hand-made results tables."""

import math

import pytest

from claas_verl.metrics import benchmark as benchmark_metrics

ORDER = ("a", "b", "c")
# a learned in stage 1, b in 2, c in 3; stage 4 = recovery
RUN = {1: {"a": 0.9}, 2: {"a": 0.5, "b": 0.8}, 3: {"a": 0.3, "b": 0.6, "c": 0.7}}


def test_run_metrics_hand_derived():
    m = benchmark_metrics.run_metrics(RUN, ORDER)
    assert m["final_avg"] == pytest.approx((0.3 + 0.6 + 0.7) / 3)
    # BWT: ((0.3 - 0.9) + (0.6 - 0.8)) / 2 = -0.4
    assert m["bwt"] == pytest.approx(-0.4)
    # forgetting: a: max(0.9, 0.5) - 0.3 = 0.6; b: 0.8 - 0.6 = 0.2 -> 0.4
    assert m["forgetting"] == pytest.approx(0.4)


def test_forgetting_uses_the_best_earlier_score_not_the_learning_stage():
    # a got better after its own stage (0.2 -> 0.8) and then fell to 0.5: BWT says +0.3, forgetting says 0.3
    run = {1: {"a": 0.2}, 2: {"a": 0.8, "b": 0.9}, 3: {"a": 0.5, "b": 0.9, "c": 0.4}}
    m = benchmark_metrics.run_metrics(run, ORDER)
    assert m["bwt"] == pytest.approx(((0.5 - 0.2) + 0.0) / 2)
    assert m["forgetting"] == pytest.approx((0.3 + 0.0) / 2)


def test_recovery_stage_is_the_final_model_and_forgetting_is_never_negative():
    run = dict(RUN)
    run[4] = {"a": 0.95, "b": 0.7, "c": 0.65}  # recovery raised a above every earlier score
    m = benchmark_metrics.run_metrics(run, ORDER)
    assert m["final_avg"] == pytest.approx((0.95 + 0.7 + 0.65) / 3)
    assert m["bwt"] == pytest.approx(((0.95 - 0.9) + (0.7 - 0.8)) / 2)
    # a: max(0.9, 0.5, 0.3) - 0.95 < 0 -> 0; b: max(0.8, 0.6) - 0.7 = 0.1
    assert m["forgetting"] == pytest.approx(0.05)


def test_json_string_stage_keys_are_accepted():
    m = benchmark_metrics.run_metrics({str(k): v for k, v in RUN.items()}, ORDER)
    assert m["forgetting"] == pytest.approx(0.4)


def test_joint_has_no_forgetting_and_norm_is_hand_derived():
    base = {"a": 0.1, "b": 0.0, "c": 0.2}
    experts = {"expert:a": {"a": 0.9, "b": 0.1, "c": 0.2}, "expert:b": {"a": 0.1, "b": 1.0, "c": 0.3},
               "expert:c": {"a": 0.0, "b": 0.0, "c": 0.6}}
    m = benchmark_metrics.run_metrics({1: {"a": 0.5, "b": 0.5, "c": 0.4}}, ORDER, staged=False, base=base,
                                      experts=experts)
    assert m["bwt"] is None and m["forgetting"] is None
    # best expert per domain: 0.9, 1.0, 0.6; Norm = (0.4 + 0.5 + 0.2) / (0.8 + 1.0 + 0.4)
    assert m["norm"] == pytest.approx(1.1 / 2.2)


def test_missing_scores_are_refused_naming_the_stage_and_domain():
    with pytest.raises(ValueError, match=r"stage_scores\[2\] has no score for domain 'b'"):
        benchmark_metrics.run_metrics({1: {"a": 0.9}, 2: {"a": 0.5}, 3: {"a": 0.3, "b": 0.6, "c": 0.7}}, ORDER)
    with pytest.raises(ValueError, match="must evaluate stage 3"):
        benchmark_metrics.run_metrics({1: {"a": 0.9}, 2: {"a": 0.5, "b": 0.8}}, ORDER, staged=True)
    with pytest.raises(ValueError, match="empty"):
        benchmark_metrics.run_metrics({}, ORDER)


def test_mean_half_width_is_the_t_interval_of_the_mean():
    m, hw = benchmark_metrics.mean_half_width([0.2, 0.4, 0.6])
    assert m == pytest.approx(0.4)
    # s = 0.2, t_{0.975, 2} = 4.302653, hw = t * s / sqrt(3)
    assert hw == pytest.approx(4.302653 * 0.2 / math.sqrt(3), rel=1e-6)
    assert benchmark_metrics.mean_half_width([0.3]) == [0.3, None]
    assert benchmark_metrics.mean_half_width([None, None]) == [None, None]
    assert benchmark_metrics.mean_half_width([0.5, None, 0.5]) == [0.5, 0.0]


def test_summarize_groups_runs_by_recipe_and_keeps_none_for_joint_forgetting():
    runs = [{"recipe": "seq", "seed": s, "final_avg": f, "forgetting": g, "bwt": -g, "norm": None}
            for s, f, g in ((1, 0.4, 0.3), (2, 0.5, 0.2), (3, 0.6, 0.1))]
    runs += [{"recipe": "joint", "seed": 1, "final_avg": 0.7, "forgetting": None, "bwt": None, "norm": 0.9}]
    s = benchmark_metrics.summarize(runs)
    assert list(s) == ["seq", "joint"]
    assert s["seq"]["seeds"] == [1, 2, 3]
    assert s["seq"]["final_avg"][0] == pytest.approx(0.5)
    assert s["seq"]["forgetting"][1] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-6)
    assert s["joint"]["forgetting"] == [None, None]
    assert s["joint"]["norm"] == [0.9, None]


def test_mean_stage_scores_per_stage_and_domain():
    runs = [{"stage_scores": {1: {"a": 0.8}, 2: {"a": 0.4, "b": 0.9}}},
            {"stage_scores": {"1": {"a": 1.0}, "2": {"a": 0.6, "b": 0.7}}}]
    cells = benchmark_metrics.mean_stage_scores(runs)
    assert cells[1]["a"][0] == pytest.approx(0.9)
    assert cells[2]["b"][0] == pytest.approx(0.8)
    # two seeds: t_{0.975, 1} = 12.7062, s = 0.1414, hw = t * s / sqrt(2) = 12.7062 * 0.1
    assert cells[2]["a"][1] == pytest.approx(12.7062 * 0.1, rel=1e-4)


def test_paired_differences_pair_by_seed_and_skip_the_baseline():
    # Seeds share a lot (the same stage-1 student): the methods' spreads overlap, the per-seed differences do not.
    # seq: 0.10, 0.30, 0.50; replay: 0.15, 0.36, 0.53 -> differences 0.05, 0.06, 0.03 (mean 0.0467, s = 0.01528)
    runs = [{"recipe": "seq", "seed": s, "final_avg": f, "forgetting": 0.2} for s, f in ((1, 0.1), (2, 0.3), (3, 0.5))]
    runs += [{"recipe": "replay", "seed": s, "final_avg": f, "forgetting": None}
             for s, f in ((3, 0.53), (1, 0.15), (2, 0.36))]
    runs += [{"recipe": "other", "seed": 9, "final_avg": 1.0, "forgetting": 0.0}]  # no common seed: left out
    d = benchmark_metrics.paired_differences(runs, "seq")
    assert list(d) == ["replay"] and d["replay"]["seeds"] == [1, 2, 3]
    m, hw = d["replay"]["final_avg"]
    assert m == pytest.approx(0.14 / 3)
    assert hw == pytest.approx(4.302653 * math.sqrt(((0.05 - m) ** 2 + (0.06 - m) ** 2 + (0.03 - m) ** 2) / 2)
                               / math.sqrt(3), rel=1e-5)
    assert m - hw > 0  # the paired interval excludes 0 ...
    (ms, hs), (mr, hr) = (benchmark_metrics.summarize(runs)[k]["final_avg"] for k in ("seq", "replay"))
    assert mr - hr < ms + hs  # ... while the two methods' own intervals overlap
    assert d["replay"]["forgetting"] == [None, None]  # no difference where one side has no value


def test_stage_gain_is_the_score_right_after_the_domains_own_stage_minus_pi0():
    base = {"a": 0.5, "b": 0.1, "c": 0.3}
    m = benchmark_metrics.run_metrics(RUN, ORDER, base=base)
    # a after stage 1: 0.9 - 0.5; b after stage 2: 0.8 - 0.1; c after stage 3: 0.7 - 0.3 (later stages do not count)
    assert m["stage_gain"] == pytest.approx({"a": 0.4, "b": 0.7, "c": 0.4})
    assert m["min_stage_gain"] == pytest.approx(0.4)
    # joint MOPD has one stage that trains every domain: the gain is read at the end
    joint = benchmark_metrics.run_metrics({1: {"a": 0.6, "b": 0.1, "c": 0.2}}, ORDER, staged=False, base=base)
    assert joint["stage_gain"] == pytest.approx({"a": 0.1, "b": 0.0, "c": -0.1})
    assert "stage_gain" not in benchmark_metrics.run_metrics(RUN, ORDER)  # no π0 score, no gain
    with pytest.raises(ValueError, match=r"π0's score is missing for \['c'\]"):
        benchmark_metrics.stage_gains(RUN, ORDER, {"a": 0.5, "b": 0.1})


def test_gain_summary_over_seeds_skips_runs_without_gains():
    runs = [{"recipe": "seq", "seed": s, "stage_gain": {"a": g, "b": 2 * g}} for s, g in ((1, 0.1), (2, 0.3))]
    runs.append({"recipe": "old", "seed": 1})
    out = benchmark_metrics.gain_summary(runs)
    assert list(out) == ["seq"]
    assert out["seq"]["a"][0] == pytest.approx(0.2) and out["seq"]["b"][0] == pytest.approx(0.4)
    assert out["seq"]["a"][1] == pytest.approx(12.706205 * math.sqrt(0.02) / math.sqrt(2), rel=1e-6)
