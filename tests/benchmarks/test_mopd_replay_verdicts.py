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
    assert out["not_learning"] == ["o2: mopd/gym_replay_kl seed 2 (smallest stage gain 0.100)"]


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
