"""benchmarks/mopd_replay_verdicts.py: the replay plan's paired statistics and reading rule, on hand-made results."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import mopd_replay_verdicts as verdicts  # noqa: E402

T_975_2 = 4.302652729911275  # Student's t quantile, 2 degrees of freedom


def _run(recipe: str, seed: int, forgetting: float, final: float = 0.5, gain: float = 0.4) -> dict:
    return {"recipe": recipe, "seed": seed, "kind": "mopd", "forgetting": forgetting, "final_avg": final,
            "min_stage_gain": gain}


def _results(directory: Path, runs: list[dict]) -> Path:
    directory.mkdir(parents=True)
    (directory / "results.json").write_text(json.dumps({"runs": runs}))
    return directory


def test_reading_rule():
    assert verdicts.reading(0.2, 0.1) == "more" and verdicts.reading(-0.2, 0.1) == "less"
    assert verdicts.reading(0.05, 0.1) == "no difference detected at ± 0.100"
    assert verdicts.reading(0.3, None) == "no interval"


def test_trainer_pairs_by_seed_within_each_order_and_pools_the_orders_apart(tmp_path):
    seq, rep = "mopd/gym_seq", "mopd/gym_replay_kl"
    # order 1: replay − Seq = 0.1, 0.2, 0.3 (seeds 1-3); order 2, the same seeds: 0.11, 0.12, 0.13; seed 4 has
    # no Seq run and is left out
    o1 = _results(tmp_path / "o1", [_run(seq, s, 0.1) for s in (1, 2, 3)]
                  + [_run(rep, s, 0.1 + d) for s, d in ((1, 0.1), (2, 0.2), (3, 0.3))] + [_run(rep, 4, 0.9)])
    o2 = _results(tmp_path / "o2", [_run(seq, s, 0.2) for s in (1, 2, 3)]
                  + [_run(rep, s, 0.2 + d, gain=0.1 if s == 2 else 0.4) for s, d in ((1, 0.11), (2, 0.12), (3, 0.13))])
    out = verdicts.trainer_verdicts([o1, o2], seq)
    f = out["comparisons"][rep]["forgetting"]
    first = f["orders"]["o1"]
    assert first["seeds"] == [1, 2, 3] and first["mean"] == pytest.approx(0.2)
    assert first["hw"] == pytest.approx(T_975_2 * 0.1 / math.sqrt(3))  # s = 0.1
    assert first["reading"].startswith("no difference detected")
    second = f["orders"]["o2"]
    assert second["mean"] == pytest.approx(0.12) and second["reading"] == "more" and second["higher"] == 3
    pooled = f["pooled"]
    assert len(pooled["seeds"]) == 6  # seed s of each order is its own pair
    assert pooled["mean"] == pytest.approx((0.6 + 0.36) / 6) and pooled["reading"] == "more"
    assert out["not_learning"] == ["order o2: mopd/gym_replay_kl seed 2 (smallest stage gain 0.100)"]


def _proxy(directory: Path, arm: str, order: int, seed: int, forgetting: float, grad_norms: dict[int, float]) -> None:
    steps = [{"stage": 1, "kind": "new", "metrics": {"actor/grad_norm": 1.0}}]
    for stage, g in grad_norms.items():  # the first replay step of the stage, then a later one that is ignored
        steps += [{"stage": stage, "kind": "replay", "metrics": {"actor/grad_norm": g}},
                  {"stage": stage, "kind": "replay", "metrics": {"actor/grad_norm": 1000.0}}]
    run = {"metrics": {"forgetting": forgetting, "final_avg": 0.5, "min_stage_gain": 0.4}, "steps": steps}
    (directory / f"{arm}_lr1e-3_n12_o{order}_s{seed}.json").write_text(json.dumps(run))


def test_proxy_pairs_arm_and_reference_and_takes_the_first_replay_steps_grad_norm_ratio(tmp_path):
    for order in (1, 2):
        for seed in (10, 11):
            _proxy(tmp_path, "paper", order, seed, 0.2, {2: 10.0, 3: 20.0})
            _proxy(tmp_path, "e2", order, seed, 0.1 + 0.001 * seed, {2: 5.0, 3: 20.0 * (0.5 if order == 1 else 1)})
    _proxy(tmp_path, "e2x", 1, 10, 9.0, {2: 1.0})  # another arm whose name starts like this one's: not read
    out = verdicts.proxy_verdicts(tmp_path, "e2", "paper")
    f = out["comparisons"]["forgetting"]
    # e2 − paper: 0.110 − 0.2 and 0.111 − 0.2 in each order
    assert f["orders"]["order 1"]["mean"] == pytest.approx(-0.0895) and f["orders"]["order 1"]["hw"] is not None
    assert len(f["pooled"]["seeds"]) == 4 and f["pooled"]["reading"] == "less"
    # ratios: stage 2 0.5 (4 runs), stage 3 0.5 (order 1) and 1.0 (order 2): median of [.5]*6 + [1]*2 = 0.5
    assert out["first_replay_grad_norm_ratio"] == {"median": 0.5, "n": 8}


def test_the_cli_prints_the_verdicts_and_refuses_a_missing_directory(tmp_path, capsys):
    seq, rep = "mopd/gym_seq", "mopd/gym_replay_kl_floor"
    o1 = _results(tmp_path / "o1", [_run(seq, s, 0.2) for s in (1, 2, 3)] + [_run(rep, s, 0.1 - 0.001 * s)
                                                                                for s in (1, 2, 3)])
    assert verdicts.main(["--json", str(tmp_path / "v.json"), "trainer", str(o1)]) == 0
    text = capsys.readouterr().out
    assert "mopd/gym_replay_kl_floor, forgetting" in text and "pooled: -0.102" in text and "; less" in text
    saved = json.loads((tmp_path / "v.json").read_text())
    assert saved["comparisons"][rep]["forgetting"]["pooled"]["reading"] == "less"
    with pytest.raises(SystemExit, match="results.json is missing"):
        verdicts.main(["trainer", str(tmp_path / "nowhere")])


def _step_log(directory: Path, name: str, rows: list[tuple[int, str, float]]) -> str:
    import gzip

    path = directory / "steps" / f"{name}.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        for stage, kind, kl in rows:
            fh.write(json.dumps({"stage": stage, "kind": kind, "metrics": {"mopd/probe_kl/a": kl}}) + "\n")
    return str(path.relative_to(directory))


def test_attribution_splits_a_stages_probe_rise_into_its_step_kinds_by_hand(tmp_path):
    d = tmp_path / "o1"
    d.mkdir()
    # stage 2 of run 1: 0 → 0.3 (new) → 0.1 (replay) → 0.5 (new) → 0.4 (replay): new +0.7, replay −0.3, total 0.4
    log1 = _step_log(d, "r1", [(1, "new", 2.0), (2, "new", 0.3), (2, "replay", 0.1), (2, "new", 0.5),
                               (2, "replay", 0.4), (3, "new", 9.0)])
    # run 2: new +0.2, replay 0, total 0.2
    log2 = _step_log(d, "r2", [(2, "new", 0.1), (2, "replay", 0.1), (2, "new", 0.2)])
    runs = [dict(_run("mopd/gym_replay_kl", s, 0.1), order=["a", "b"], step_log=log) for s, log in ((1, log1),
                                                                                                  (2, log2))]
    (d / "results.json").write_text(json.dumps({"runs": runs}))
    out = verdicts.attribution([d], stage=2)["recipes"]["mopd/gym_replay_kl"]
    assert [(r["new"], r["replay"], r["total"]) for r in out["runs"]] == [
        pytest.approx((0.7, -0.3, 0.4)), pytest.approx((0.2, 0.0, 0.2))]
    assert out["new"][0] == pytest.approx(0.45) and out["total"][0] == pytest.approx(0.3)
    # totals 0.4 and 0.2: s = 0.1·√2, half-width t_{0.975, 1} · s / √2 = 12.7062 · 0.1
    assert out["total"][1] == pytest.approx(12.706204736174698 * 0.1)
    with pytest.raises(ValueError, match="no mopd/probe_kl/b after every step"):
        verdicts.probe_rise_by_kind(verdicts.read_step_log(d / log1), 2, "b")


def test_attribution_pairs_each_recipes_new_domain_part_with_the_reference_run_by_run(tmp_path):
    d = tmp_path / "o1"
    d.mkdir()
    runs = []
    for seed, (seq_kl, rep_new, rep_replay) in enumerate([(0.2, 0.5, -0.1), (0.3, 0.5, 0.0), (0.1, 0.4, -0.2)]):
        runs.append(dict(_run("mopd/gym_seq", seed, 0.1), order=["a"],
                         step_log=_step_log(d, f"seq{seed}", [(2, "new", seq_kl)])))
        rows = [(2, "new", rep_new), (2, "replay", rep_new + rep_replay)]
        runs.append(dict(_run("mopd/gym_replay_kl", seed, 0.1), order=["a"], step_log=_step_log(d, f"rep{seed}", rows)))
    (d / "results.json").write_text(json.dumps({"runs": runs}))
    pairs = verdicts.attribution_paired(verdicts.attribution([d], stage=2), "mopd/gym_seq")["mopd/gym_replay_kl"]
    assert pairs["new"]["mean"] == pytest.approx((0.3 + 0.2 + 0.3) / 3) and pairs["new"]["higher"] == 3
    assert pairs["total"]["mean"] == pytest.approx((0.2 + 0.2 + 0.1) / 3)
    with pytest.raises(SystemExit, match="no mopd/other runs to pair with"):
        verdicts.attribution_paired(verdicts.attribution([d], stage=2), "mopd/other")


def test_proxy_attribution_reads_the_proxys_step_records(tmp_path):
    for arm, replay_kl in (("paper", 0.1), ("e2", 0.3)):
        for order in (1, 2):
            steps = [{"stage": 2, "kind": "new", "metrics": {"mopd/probe_kl/a": 0.5}},
                     {"stage": 2, "kind": "replay", "metrics": {"mopd/probe_kl/a": replay_kl}}]
            run = {"order": ["a", "b"], "steps": steps, "metrics": {}}
            (tmp_path / f"{arm}_lr1e-3_n12_o{order}_s10.json").write_text(json.dumps(run))
    out = verdicts.proxy_attribution(tmp_path, ["paper", "e2"], stage=2)
    assert out["recipes"]["paper"]["replay"][0] == pytest.approx(-0.4) and out["recipes"]["e2"]["total"][0] == 0.3
    pairs = verdicts.attribution_paired(out, "paper")["e2"]
    assert pairs["total"]["seeds"] == [("order 1", 10), ("order 2", 10)]
    assert pairs["total"]["mean"] == pytest.approx(0.2)


def test_a_proxy_directory_with_several_learning_rates_needs_one_named(tmp_path):
    for seed, (f_1e3, f_3e4) in enumerate([(0.3, 0.1), (0.4, 0.2)], start=10):
        _proxy(tmp_path, "paper", 1, seed, f_1e3, {2: 1.0})
        run = {"metrics": {"forgetting": f_3e4, "final_avg": 0.5, "min_stage_gain": 0.4}, "steps": []}
        (tmp_path / f"paper_lr3e-4_n40_o1_s{seed}.json").write_text(json.dumps(run))
    with pytest.raises(SystemExit, match=r"lr 1e-3 with 12 steps, lr 3e-4 with 40 steps: name one with --lr"):
        verdicts.proxy_runs(tmp_path, "paper")
    assert {k: r["metrics"]["forgetting"] for k, r in verdicts.proxy_runs(tmp_path, "paper", "3e-4").items()} == {
        (1, 10): 0.1, (1, 11): 0.2}


def test_contrast_takes_a_difference_of_differences_pair_by_pair(tmp_path):
    # (paper − seq) at 3e-4 minus (paper − seq) at 1e-3, seeds 10-12, order 1: by hand 0.05, −0.02, 0.03
    values = {("paper", "3e-4"): (0.30, 0.20, 0.25), ("seq", "3e-4"): (0.20, 0.20, 0.20),
              ("paper", "1e-3"): (0.40, 0.30, 0.30), ("seq", "1e-3"): (0.35, 0.28, 0.28)}
    for (arm, lr), fs in values.items():
        for seed, f in zip((10, 11, 12), fs):
            run = {"order": ["a", "b"], "metrics": {"forgetting": f, "final_avg": 0.5, "min_stage_gain": 0.4}}
            (tmp_path / f"{arm}_lr{lr}_n12_o1_s{seed}.json").write_text(json.dumps(run))
    spec = lambda arm, lr: f"proxy:{tmp_path}/{arm}@{lr}"  # noqa: E731
    series = dict(verdicts.parse_series(spec(a, lr)) for a, lr in values)
    out = verdicts.contrast(series, spec("paper", "3e-4"), spec("seq", "3e-4"), spec("paper", "1e-3"),
                            spec("seq", "1e-3"))
    f = out["comparisons"]["forgetting"]
    assert f["pooled"]["seeds"] == [("a→b", 10), ("a→b", 11), ("a→b", 12)]
    assert f["pooled"]["mean"] == pytest.approx(0.02) and f["pooled"]["higher"] == 2
    assert f["orders"]["a→b"]["hw"] == pytest.approx(T_975_2 * math.sqrt(0.0013) / math.sqrt(3))  # s² = 0.0013
    assert out["first_replay_grad_norm_ratio"] == {"median": None, "n": 0}  # not a plain contrast
    with pytest.raises(SystemExit, match="needs both --base-arm and --base-reference"):
        verdicts.contrast(series, spec("paper", "3e-4"), spec("seq", "3e-4"), spec("paper", "1e-3"))
    with pytest.raises(SystemExit, match="a series is proxy:DIR/ARM"):
        verdicts.parse_series(f"{tmp_path}/paper")


def test_contrast_pairs_one_recipe_across_result_directories_and_reads_the_step_logs(tmp_path, capsys):
    import gzip

    def directory(name: str, order: list[str], runs: list[tuple[int, float, float, str]]) -> Path:
        d = tmp_path / name
        (d / "steps").mkdir(parents=True)
        rows = []
        for seed, forgetting, grad, bundle in runs:
            log = f"steps/s{seed}.jsonl.gz"
            with gzip.open(d / log, "wt") as fh:
                for stage, g in ((1, 99.0), (2, grad), (2, 7.0)):  # stage 1 has no replay; the 2nd replay is ignored
                    fh.write(json.dumps({"stage": stage, "kind": "new" if stage == 1 else "replay",
                                         "metrics": {"actor/grad_norm": g}}) + "\n")
            rows.append(dict(_run("mopd/gym_replay_kl", seed, forgetting), order=order, step_log=log,
                             bundle_fingerprint=bundle))
        (d / "results.json").write_text(json.dumps({"runs": rows}))
        return d

    # E2-like: the arm's directories hold the same recipe as the reference's; order 2's reference comes first
    arm = [directory("e2_o1", ["x", "y"], [(31, 0.10, 4.0, "b"), (32, 0.20, 6.0, "b")]),
           directory("e2_o2", ["y", "x"], [(31, 0.30, 5.0, "b")])]
    ref = [directory("e1_o2", ["y", "x"], [(31, 0.50, 10.0, "b")]),
           directory("e1_o1", ["x", "y"], [(31, 0.15, 8.0, "b"), (32, 0.10, 12.0, "b")])]
    spec = lambda dirs: "trainer:mopd/gym_replay_kl@" + ",".join(map(str, dirs))  # noqa: E731
    assert verdicts.main(["contrast", "--arm", spec(arm), "--reference", spec(ref)]) == 0
    text = capsys.readouterr().out
    # x→y: −0.05, +0.10; y→x: −0.20; ratios 4/8, 6/12, 5/10 = 0.5
    assert "x→y: +0.025" in text and "y→x: -0.200" in text and "pooled: -0.050" in text
    assert "median 0.500 over 3 (stage, seed) pairs" in text
    other_bundle = [directory("e1b_o1", ["x", "y"], [(31, 0.15, 8.0, "c")])]
    with pytest.raises(SystemExit, match=r"different bundles \['b', 'c'\]"):
        verdicts.main(["contrast", "--arm", spec(arm), "--reference", spec(other_bundle)])
    _proxy(tmp_path, "paper", 1, 31, 0.2, {2: 1.0})
    with pytest.raises(SystemExit, match="mix stage-proxy and trainer runs"):
        verdicts.main(["contrast", "--arm", spec(arm), "--reference", f"proxy:{tmp_path}/paper"])


def test_trainer_labels_each_order_by_its_domains_and_refuses_a_directory_given_twice(tmp_path):
    seq, rep = "mopd/gym_seq", "mopd/gym_replay_kl"
    runs = [dict(_run(seq, s, 0.2), order=["x", "y"]) for s in (1, 2)]
    runs += [dict(_run(rep, s, f), order=["x", "y"]) for s, f in ((1, 0.3), (2, 0.25))]
    o1 = _results(tmp_path / "anything", runs)
    f = verdicts.trainer_verdicts([o1], seq)["comparisons"][rep]["forgetting"]
    assert list(f["orders"]) == ["x→y"] and f["pooled"]["mean"] == pytest.approx(0.075)
    assert f["pooled"]["seeds"] == [("x→y", 1), ("x→y", 2)]
    with pytest.raises(SystemExit, match="seed 1 in order x→y appears twice"):
        verdicts.trainer_verdicts([o1, o1], seq)


def test_the_plans_secondary_metrics_are_compared_where_every_run_carries_them(tmp_path):
    seq, rep = "mopd/gym_seq", "mopd/gym_replay_kl"

    def run(recipe: str, seed: int, after2: float, after3: float, kl3: float) -> dict:
        return dict(_run(recipe, seed, 0.1), order=["x", "y", "z"],
                    stage_scores={"1": {"x": 0.9}, "2": {"x": after2, "y": 0.8},
                                  "3": {"x": after3, "y": 0.7, "z": 0.6}},
                    kl_to_expert={"3": {"x": kl3, "y": 0.1, "z": 0.1}})

    o1 = _results(tmp_path / "o1", [run(seq, 1, 0.5, 0.4, 0.3), run(seq, 2, 0.6, 0.5, 0.2),
                                    run(rep, 1, 0.7, 0.45, 0.1), run(rep, 2, 0.7, 0.65, 0.1)])
    row = verdicts.trainer_verdicts([o1], seq)["comparisons"][rep]
    assert row["first_after_2"]["pooled"]["mean"] == pytest.approx(0.15)   # 0.2, 0.1
    assert row["first_after_3"]["pooled"]["mean"] == pytest.approx(0.1)    # 0.05, 0.15
    assert row["first_kl_to_expert_3"]["pooled"]["mean"] == pytest.approx(-0.15)  # −0.2, −0.1
    # a proxy record has stage scores but no KL to the expert: only what every run carries is compared
    for arm, after3 in (("paper", 0.3), ("seq", 0.5)):
        rec = {"order": ["x", "y", "z"], "stage_scores": {"2": {"x": 0.6}, "3": {"x": after3}},
               "metrics": {"forgetting": 0.1, "final_avg": 0.5, "min_stage_gain": 0.4}}
        (tmp_path / f"{arm}_lr1e-3_n12_o1_s10.json").write_text(json.dumps(rec))
    out = verdicts.proxy_verdicts(tmp_path, "paper", "seq")["comparisons"]
    assert set(out) == {"forgetting", "final_avg", "first_after_2", "first_after_3"}
    assert out["first_after_3"]["pooled"]["mean"] == pytest.approx(-0.2)


def test_pairs_are_counted_by_the_machines_their_runs_were_made_on(tmp_path, capsys):
    a = {"cpu": "A", "cpu_capability": "AVX2", "torch": "2.13.0"}
    b = {**a, "cpu_capability": "AVX512"}  # same CPU name, other kernels: another machine's arithmetic
    hosts = {10: (a, a), 11: (a, b), 12: (None, a), 13: (b, b)}
    for seed, (arm_host, ref_host) in hosts.items():
        for arm, host, f in (("e5", arm_host, 0.1), ("paper", ref_host, 0.2)):
            _proxy(tmp_path, arm, 1, seed, f, {2: 1.0})
            path = tmp_path / f"{arm}_lr1e-3_n12_o1_s{seed}.json"
            run = json.loads(path.read_text())
            if host is not None:
                run["host"] = host
            path.write_text(json.dumps(run))
    assert verdicts.proxy_verdicts(tmp_path, "e5", "paper")["machines"] == {"one": 2, "across": 1, "unrecorded": 1}
    assert verdicts.main(["proxy", str(tmp_path), "--arm", "e5", "--reference", "paper"]) == 0
    assert ("pairs by machine: 2 made on one machine, 1 across machines, 1 with a run whose record names no machine"
            in capsys.readouterr().out)
