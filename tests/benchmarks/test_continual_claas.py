"""The CLaaS half of the continual benchmark (benchmarks/continual_claas.py): its arithmetic on hand-made runs,
the record it reads from a run directory, its plots, and (slow) one real quick run through main_claas."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import continual_claas as claas_bench  # noqa: E402

from claas_verl.metrics.continual import continual_metrics, write_continual_metrics  # noqa: E402

T_975_2 = 4.302652729911275  # Student t quantile 0.975 with 2 degrees of freedom (3 seeds)


def _const(v: float) -> list[list[float]]:
    return [[v] * 5 for _ in range(5)]


# Three seeds of method A and one of method B, with metrics derived by hand (K = 5):
#   s1: every cell 0.5                        -> FWT 0.5, forgetting 0,   final 0.5
#   s2: above diag 0.2, diag 0.8, below 0.4   -> FWT 0.2, forgetting 0.4 (each column: 0.8 on the diagonal,
#                                                0.4 in the last row), final (4*0.4 + 0.8)/5 = 0.48
#   s3: every cell 0.1, last row 1.0          -> FWT 0.1 (the last row has no cell above the diagonal),
#                                                forgetting 0 (the last row is each column's max), final 1.0
#   B:  identity                              -> FWT 0, forgetting 1, final 0.2
M_S2 = [[0.8 if j == k else (0.2 if k > j else 0.4) for k in range(5)] for j in range(5)]
M_S3 = [[1.0 if j == 4 else 0.1 for _ in range(5)] for j in range(5)]
M_B = [[1.0 if j == k else 0.0 for k in range(5)] for j in range(5)]
HAND = [("claas/a", 1, _const(0.5), 0.5, 0.0, 0.5), ("claas/a", 2, M_S2, 0.2, 0.4, 0.48),
        ("claas/a", 3, M_S3, 0.1, 0.0, 1.0), ("claas/b", 1, M_B, 0.0, 1.0, 0.2)]


def _runs() -> list[dict]:
    return [{"recipe": r, "seed": s, "M": M, "stage_scores": {j + 1: {f"split_{k + 1}": M[j][k] for k in range(5)}
                                                               for j in range(5)},
             "forward_transfer": fwt, "forgetting": fg, "final_avg": fin, "updates": 10 * s,
             "reward_curve": [[u, 0.1 * s] for u in range(1, 10 * s + 1)], "rollout_mean_reward": 0.3}
            for r, s, M, fwt, fg, fin in HAND]


def test_hand_values_match_the_trainer_metrics():
    for _, _, M, fwt, fg, fin in HAND:
        m = continual_metrics(M)
        assert (m.forward_transfer, m.forgetting, m.final) == pytest.approx((fwt, fg, fin), abs=1e-9)


def test_summary_means_and_half_widths_by_hand():
    s = claas_bench.claas_summary(_runs())
    assert list(s) == ["claas/a", "claas/b"]
    a, b = s["claas/a"], s["claas/b"]
    assert a["seeds"] == [1, 2, 3] and b["seeds"] == [1]
    # final 0.5, 0.48, 1.0: mean 0.66, squared deviations 0.0256 + 0.0324 + 0.1156 = 0.1736, s^2 = 0.0868
    assert a["final_avg"] == pytest.approx([0.66, T_975_2 * math.sqrt(0.0868) / math.sqrt(3)], abs=1e-9)
    # forgetting 0, 0.4, 0: mean 0.4/3, squared deviations (0.4/3)^2*2 + (0.8/3)^2 = 0.96/9, s^2 = 0.48/9
    assert a["forgetting"] == pytest.approx([0.4 / 3, T_975_2 * math.sqrt(0.48 / 9) / math.sqrt(3)], abs=1e-9)
    # FWT 0.5, 0.2, 0.1: mean 0.8/3, squared deviations (0.7/3)^2 + (0.2/3)^2 + (0.5/3)^2 = 0.78/9, s^2 = 0.39/9
    assert a["forward_transfer"] == pytest.approx([0.8 / 3, T_975_2 * math.sqrt(0.39 / 9) / math.sqrt(3)], abs=1e-9)
    assert a["updates"] == pytest.approx([20.0, T_975_2 * 10.0 / math.sqrt(3)])  # 10, 20, 30: s = 10
    # one seed: the mean, no interval
    assert b["final_avg"] == [pytest.approx(0.2), None]
    assert b["forgetting"] == [pytest.approx(1.0), None]
    assert b["forward_transfer"] == [pytest.approx(0.0), None]
    # the displayed mean matrix is cell-wise: (0, 1) = (0.5 + 0.2 + 0.1)/3, (4, 0) = (0.5 + 0.4 + 1.0)/3
    assert a["M_mean"][0][1] == pytest.approx(0.8 / 3) and a["M_mean"][4][0] == pytest.approx(1.9 / 3)
    assert b["M_mean"] == M_B


def test_summary_is_order_invariant_and_skips_missing_metrics():
    runs = _runs()
    s1 = claas_bench.claas_summary(runs)
    s2 = claas_bench.claas_summary(runs[2::-1] + runs[3:])  # seeds of A in reverse order
    for k in claas_bench.METRIC_KEYS:
        assert s2["claas/a"][k] == pytest.approx(s1["claas/a"][k])
    runs[1]["forgetting"] = None  # a run whose M had an ungradable cell: its metrics are null
    s3 = claas_bench.claas_summary(runs)
    assert s3["claas/a"]["forgetting"][0] == pytest.approx(0.0)  # seeds 1 and 3 only: 0 and 0
    assert s3["claas/a"]["forgetting"][1] == pytest.approx(0.0)


def test_report_tables():
    runs = _runs()
    text = claas_bench.claas_report(runs, claas_bench.claas_summary(runs))
    hw_final = T_975_2 * math.sqrt(0.0868) / math.sqrt(3)
    row_a = next(line for line in text.splitlines() if line.startswith("| claas/a |"))
    assert f"| 3 | 0.660 ± {hw_final:.3f} | 0.133 ± " in row_a
    row_b = next(line for line in text.splitlines() if line.startswith("| claas/b |"))
    assert "| 1 | 0.200 | 1.000 | 0.000 | 10.0 |" in row_b
    # A's mean M: row "after split 5" = (0.5+0.4+1)/3 x4, then (0.5+0.8+1)/3
    assert "| after split 5 | 0.63 | 0.63 | 0.63 | 0.63 | 0.77 |" in text
    assert "### claas/b: mean M[j, k] over 1 seed(s)" in text
    assert ("| checkpoint \\ split | 1 (capital_start) | 2 (capital_start) | 3 (lowercase) | 4 (lowercase) | "
            "5 (lowercase) |") in text
    assert "Splits by rule (one rule per scenario, `claas.stream.split_groups`): 1: `capital_start`" in text
    # rule means of method A, after split 1: capital_start (splits 1-2) per seed 0.5, (0.8+0.2)/2, 0.1
    hw = T_975_2 * math.sqrt(((0.5 - 1.1 / 3) ** 2 + (0.5 - 1.1 / 3) ** 2 + (0.1 - 1.1 / 3) ** 2) / 2) / math.sqrt(3)
    row = next(line for line in text.splitlines() if line.startswith("| claas/a | `capital_start` |"))
    assert row.split(" | ")[2] == f"{1.1 / 3:.2f} ± {hw:.2f}"
    row_b = next(line for line in text.splitlines() if line.startswith("| claas/b | `lowercase` |"))
    assert row_b.endswith("| 0.00 | 0.00 | 0.33 | 0.33 | 0.33 |")
    assert "| after split 1 | 1.00 | 0.00 | 0.00 | 0.00 | 0.00 |" in text


def test_group_means_by_hand():
    # identity M with groups a, a, b, b, b: rule a's splits are 1-2, rule b's 3-5
    g = claas_bench.group_means(M_B, ["a", "a", "b", "b", "b"])
    assert g == {"a": [0.5, 0.5, 0.0, 0.0, 0.0], "b": [0.0, 0.0, 1 / 3, 1 / 3, 1 / 3]}
    # M_S2 (0.8 diagonal, 0.2 above, 0.4 below), the benchmark's own groups (capital_start x2, lowercase x3)
    g = claas_bench.group_means(M_S2)
    assert g["capital_start"] == pytest.approx([0.5, 0.6, 0.4, 0.4, 0.4])
    assert g["lowercase"] == pytest.approx([0.2, 0.2, (0.8 + 0.2 + 0.2) / 3, (0.4 + 0.8 + 0.2) / 3,
                                            (0.4 + 0.4 + 0.8) / 3])
    # a cell nobody could grade is left out of its mean
    holes = [[None, 1.0, 0.5, 0.5, 0.5]] + [[0.0] * 5 for _ in range(4)]
    assert claas_bench.group_means(holes)["capital_start"][0] == 1.0


def test_paired_with_the_baseline_by_hand():
    # baseline claas/b has seed 1 only (identity M): A's seed 1 (every cell 0.5) is the one pair
    out = claas_bench.claas_paired(_runs(), baseline="claas/b")
    assert list(out) == ["claas/a"] and out["claas/a"]["seeds"] == [1]
    row = out["claas/a"]
    assert row["final_avg"] == [pytest.approx(0.5 - 0.2), None]          # one pair: no interval
    assert row["forgetting"][0] == pytest.approx(0.0 - 1.0)
    assert row["forward_transfer"][0] == pytest.approx(0.5 - 0.0)
    # identity's capital_start (splits 1-2) means: 0.5, 0.5, 0, 0, 0; lowercase: 0, 0, 1/3, 1/3, 1/3
    assert [v for v, _ in row["rule_means"]["capital_start"]] == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.5])
    assert [v for v, _ in row["rule_means"]["lowercase"]] == pytest.approx([0.5, 0.5, 0.5 - 1 / 3, 0.5 - 1 / 3,
                                                                              0.5 - 1 / 3])
    # two paired seeds give an interval: A (seeds 1, 2) against itself shifted by +0.1 in every cell
    shifted = [dict(r, recipe="claas/base", M=[[v - 0.1 for v in row] for row in r["M"]],
                    final_avg=r["final_avg"] - 0.1, forgetting=r["forgetting"], forward_transfer=r["forward_transfer"])
               for r in _runs() if r["recipe"] == "claas/a" and r["seed"] in (1, 2)]
    both = claas_bench.claas_paired([r for r in _runs() if r["recipe"] == "claas/a"] + shifted, baseline="claas/base")
    assert both["claas/a"]["seeds"] == [1, 2]
    m, hw = both["claas/a"]["final_avg"]
    assert m == pytest.approx(0.1) and hw == pytest.approx(0.0, abs=1e-9)
    assert all(v == pytest.approx(0.1) for v, _ in both["claas/a"]["rule_means"]["lowercase"])
    # the report carries the paired table when the baseline ran
    text = claas_bench.claas_report(_runs(), claas_bench.claas_summary(_runs()))
    assert "Paired with no update" not in text  # the hand-made runs have no claas/tiny_no_update
    runs = _runs() + [dict(r, recipe=claas_bench.BASELINE) for r in _runs() if r["recipe"] == "claas/b"]
    text = claas_bench.claas_report(runs, claas_bench.claas_summary(runs))
    assert "### Paired with no update, seed by seed" in text
    assert next(line for line in text.splitlines() if line.startswith("| claas/a | 1 |")).startswith(
        "| claas/a | 1 | 0.300 | -1.000 | 0.500 | 0.00 | 0.00 | 0.50 |")


def test_mean_reward_curve_averages_the_seeds_that_reached_each_update():
    runs = [{"reward_curve": [[1, 0.0], [2, 1.0]]}, {"reward_curve": [[1, 1.0], [2, 1.0], [3, 0.5]]}, {}]
    assert claas_bench.mean_reward_curve(runs) == [[1, 0.5], [2, 1.0], [3, 0.5]]


def test_record_from_a_run_directory(tmp_path):
    M = [[0.1 * (j + k) for k in range(5)] for j in range(5)]
    write_continual_metrics(tmp_path, M, buffer_stats={"size": 0}, extra={"algorithm": "reinforce_pp", "updates": 2,
                            "producer": {"mean_reward": 0.25}, "warnings": []})
    trace = [{"event": "start"}, {"event": "update", "update": 1, "sampled": [{"reward": 1.0}, {"reward": 0.0}]},
             {"event": "split_end", "split": 1}, {"event": "update", "update": 2, "sampled": [{"reward": 1.0}]}]
    (tmp_path / "claas_trace.jsonl").write_text("".join(json.dumps(e) + "\n" for e in trace))
    rec = claas_bench.record_from_run_dir("claas/tiny_reinforce_pp", 7, tmp_path, 12.34)
    m = continual_metrics(M)
    assert rec["final_avg"] == pytest.approx(m.final) and rec["forgetting"] == pytest.approx(m.forgetting)
    assert rec["forward_transfer"] == pytest.approx(m.forward_transfer)
    assert rec["stage_scores"][2]["split_4"] == pytest.approx(0.4)  # checkpoint 2 (row 1) on split 4 (column 3)
    assert rec["reward_curve"] == [[1, 0.5], [2, 1.0]]
    assert (rec["updates"], rec["rollout_mean_reward"], rec["seconds"], rec["seed"]) == (2, 0.25, 12.3, 7)
    assert rec["host"] == claas_bench.host_signature()  # the machine, since runs differ between machines
    # a run over another K is refused with the cause
    write_continual_metrics(tmp_path, [[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(RuntimeError, match="expected 5x5"):
        claas_bench.record_from_run_dir("claas/tiny_reinforce_pp", 7, tmp_path, 1.0)


def test_overrides_carry_the_seed_and_k():
    o1, o2 = claas_bench.run_overrides("claas/tiny_ppo", 1, True), claas_bench.run_overrides("claas/tiny_ppo", 2, True)
    for key in ("claas.stream.seed", "claas.seed", "actor_rollout_ref.rollout.seed"):
        assert f"{key}=1" in o1 and f"{key}=2" in o2
    assert "claas.stream.num_splits=5" in o1 and "trainer.experiment_name=claas_tiny_ppo_s2" in o2
    # one scenario pool for every seed: the seed picks which of its scenarios land in which split
    assert "claas.env.kwargs.seed=0" in o1 and f"claas.env.kwargs.num_scenarios={claas_bench.POOL_SIZE}" in o2


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("recipe", claas_bench.METHODS)
def test_every_method_composes_into_the_grouped_stream(recipe, quick):
    """Each method's recipe, composed by Hydra with the benchmark's overrides exactly as ``claas_run`` passes them,
    builds the designed stream: split j holds only one-rule scenarios of SPLIT_GROUPS[j], S per split."""
    from hydra import compose, initialize_config_dir

    from claas_verl.claas.envs import make_environment
    from claas_verl.claas.trainer import ClaasConfig

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        cfg = compose(config_name=claas_bench.config_name(recipe),
                      overrides=claas_bench.run_overrides(recipe, 2, quick))
    c = ClaasConfig.from_config(cfg.claas)
    assert cfg.claas.eval.n_samples == claas_bench.EVAL_SAMPLES
    env = make_environment(c.env.name, **c.env.kwargs)
    stream = env.stream(seed=c.stream.seed, num_splits=c.stream.num_splits, split_size=c.stream.split_size,
                        split_groups=c.stream.split_groups, group_key=c.stream.group_key)
    size = (claas_bench.QUICK if quick else claas_bench.FULL)["split_size"]
    for j, group in enumerate(claas_bench.SPLIT_GROUPS):
        split = stream.split(j)
        assert len(split) == size
        assert all(s.meta["families"] == [group] for s in split)
        assert all(s.num_turns == (claas_bench.QUICK if quick else claas_bench.FULL)["num_turns"] for s in split)
    assert len(set(claas_bench.SPLIT_GROUPS)) == 2 and set(claas_bench.SPLIT_GROUPS) == set(claas_bench.RULE_FAMILIES)


def test_compatible_stream_overrides_and_default_unchanged():
    default = claas_bench.run_overrides("claas/tiny_ppo", 3, False)
    assert default == claas_bench.run_overrides("claas/tiny_ppo", 3, False, "contradictory")
    assert "claas.stream.split_groups=[capital_start,capital_start,lowercase,lowercase,lowercase]" in default
    assert "++claas.env.kwargs.families=[lowercase,capital_start]" in default
    comp = claas_bench.run_overrides("claas/tiny_ppo", 3, False, "compatible")
    assert ("claas.stream.split_groups=[capital_start,capital_start,end_punctuation,end_punctuation,"
            "end_punctuation]") in comp
    assert "++claas.env.kwargs.families=[capital_start,end_punctuation]" in comp
    # only the rules differ: sizes, seeds and the pool are the default stream's
    differ = [(a, b) for a, b in zip(default, comp) if a != b]
    assert len(comp) == len(default) and len(differ) == 2
    with pytest.raises(ValueError, match="unknown CLaaS stream 'nope'"):
        claas_bench.run_overrides("claas/tiny_ppo", 3, False, "nope")


def test_compatible_stream_composes_and_its_rules_can_pass_together():
    from hydra import compose, initialize_config_dir

    from claas_verl.claas.envs import make_environment
    from claas_verl.claas.trainer import ClaasConfig

    recipe = "claas/tiny_reinforce_pp"
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        cfg = compose(config_name=claas_bench.config_name(recipe),
                      overrides=claas_bench.run_overrides(recipe, 3, False, "compatible"))
    c = ClaasConfig.from_config(cfg.claas)
    env = make_environment(c.env.name, **c.env.kwargs)
    stream = env.stream(seed=c.stream.seed, num_splits=c.stream.num_splits, split_size=c.stream.split_size,
                        split_groups=c.stream.split_groups, group_key=c.stream.group_key)
    families, groups = claas_bench.STREAMS["compatible"]
    for j, group in enumerate(groups):
        split = stream.split(j)
        assert len(split) == claas_bench.FULL["split_size"] and all(s.meta["families"] == [group] for s in split)
        # the reply "Sure." passes every scenario of the stream: no rule forces another to fail
        assert all(s.grade("Sure.", t).reward == 1.0 for s in split for t in range(s.num_turns))
    assert set(groups) == set(families)


def test_report_of_the_compatible_stream():
    runs = [dict(r, stream="compatible") for r in _runs()]
    summary = claas_bench.claas_summary(runs)
    assert set(summary["claas/a"]["rule_means"]) == {"capital_start", "end_punctuation"}
    text = claas_bench.claas_report(runs, summary)
    assert ("| checkpoint \\ split | 1 (capital_start) | 2 (capital_start) | 3 (end_punctuation) | "
            "4 (end_punctuation) | 5 (end_punctuation) |") in text
    assert "A reply can pass every rule at once." in text and "contradict" not in text
    row_b = next(line for line in text.splitlines() if line.startswith("| claas/b | `end_punctuation` |"))
    assert row_b.endswith("| 0.00 | 0.00 | 0.33 | 0.33 | 0.33 |")
    with pytest.raises(ValueError, match="different CLaaS streams"):
        claas_bench.claas_summary(runs[:1] + _runs()[1:])


def test_plots_are_written(tmp_path):
    runs = _runs()
    runs[3]["reward_curve"] = []  # a method without updates: drawn as its mean rollout reward
    paths = claas_bench.claas_plots(runs, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["claas_M_claas_a.png", "claas_M_claas_b.png", "claas_final_forgetting_fwt.png",
                     "claas_reward_curve.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


@pytest.mark.slow
def test_quick_claas_run_through_main_claas(tiny, tmp_path):
    rec = claas_bench.claas_run("claas/tiny_reinforce_pp", 1, tmp_path, quick=True, extra=[])
    assert rec["recipe"] == "claas/tiny_reinforce_pp" and rec["seed"] == 1 and rec["algorithm"] == "reinforce_pp"
    M = rec["M"]
    assert len(M) == claas_bench.K == 5 and all(len(row) == 5 for row in M)
    assert all(v is None or 0.0 <= v <= 1.0 for row in M for v in row)
    assert sorted(rec["stage_scores"]) == [1, 2, 3, 4, 5]
    assert rec["updates"] >= 1 and len(rec["reward_curve"]) == rec["updates"]
    assert [u for u, _ in rec["reward_curve"]] == list(range(1, rec["updates"] + 1))
    m = continual_metrics(M)
    assert rec["final_avg"] == pytest.approx(m.final) and rec["forgetting"] == pytest.approx(m.forgetting)
    assert rec["forward_transfer"] == pytest.approx(m.forward_transfer)
    run_dir = Path(rec["run_dir"])
    assert run_dir == tmp_path / "runs" / "claas_tiny_reinforce_pp_s1"
    start = json.loads((run_dir / "claas_trace.jsonl").read_text().splitlines()[0])
    assert start["claas"]["stream"] == {"seed": 1, "num_splits": 5, "split_size": claas_bench.QUICK["split_size"],
                                        "split_groups": list(claas_bench.SPLIT_GROUPS), "group_key": "families"}
    assert rec["design"] == claas_bench.DESIGN
    assert rec["seconds"] > 0
