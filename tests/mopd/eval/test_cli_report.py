"""End to end on CPU: the tiny student through ``python -m claas_verl.mopd.eval`` (HF backend), then the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from claas_verl.metrics import mopd as mopd_metrics
from claas_verl.mopd.eval import report
from claas_verl.mopd.eval.cli import main
from claas_verl.mopd.eval.generate import HFGenerator

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "eval"


def test_hf_generator_is_seeded_and_flags_truncation(tiny):
    gen = HFGenerator(str(tiny.student), batch_size=2, max_new_tokens_cap=6)
    msgs = [[{"role": "user", "content": "Compute 2 + 3."}], [{"role": "user", "content": "Say hi."}]]
    a = gen.generate(msgs, 2, 0.7, 0.95, 8192, seed=0)
    assert [len(r) for r in a] == [2, 2]
    assert a == gen.generate(msgs, 2, 0.7, 0.95, 8192, seed=0)
    assert a != gen.generate(msgs, 2, 0.7, 0.95, 8192, seed=1)
    # one new token: a completion is untruncated only if that token ended it (then its text is empty)
    gen.cap = 1
    one = [c for r in gen.generate(msgs, 4, 1.0, 0.95, 8192, seed=0) for c in r]
    assert all(c.truncated or c.text == "" for c in one) and any(c.truncated for c in one)


def test_eval_cli_tiny_student_then_report(tiny, tmp_path):
    out = tmp_path / "runs"
    args = ["--model", str(tiny.student), "--name", "student", "--benchmarks", "BBH,GYM,MuSR,AIME24,MBPP,IFEval",
            "--seeds", "0,1", "--out", str(out), "--data-dir", str(FIX), "--backend", "hf", "--limit", "2",
            "--max-new-tokens-cap", "8", "--gym-tasks", "basic_arithmetic"]
    assert main(args) == 0
    state = json.loads((out / "student" / "scores.json").read_text())
    assert sorted(state["seeds"]) == ["0", "1"]
    assert set(state["seeds"]["0"]) == {"BBH", "GYM", "MuSR", "AIME24", "MBPP", "MBPP+", "IFEval"}
    assert all(0.0 <= v <= 100.0 for s in state["seeds"].values() for v in s.values())
    st = state["stats"]["0"]
    # samples per item from the MOPD paper's table: AIME 16, MBPP 2, IFEval 4, the logic benchmarks 1
    assert (st["BBH"]["responses"], st["AIME24"]["responses"], st["MBPP"]["responses"], st["IFEval"]["responses"]) \
        == (2, 32, 4, 8)
    recs = [json.loads(x) for x in (out / "student" / "seed0" / "AIME24.jsonl").read_text().splitlines()]
    assert len(recs) == 32 and {"id", "sample", "response", "truncated", "score", "answer"} <= set(recs[0])
    # a rerun resumes: finished (seed, benchmark) pairs are not generated again
    before = (out / "student" / "seed0" / "BBH.jsonl").stat().st_mtime_ns
    assert main(args) == 0
    assert (out / "student" / "seed0" / "BBH.jsonl").stat().st_mtime_ns == before
    # the report runs on partial benchmark sets (domain columns it cannot fill are n/a)
    assert main(["report", "--runs", str(out), "--k", "3", "--out", str(tmp_path / "t")]) == 0
    md = (tmp_path / "t.md").read_text()
    assert md.splitlines()[0].startswith("| Checkpoint | logic | math | code | Avg |") and "| student |" in md
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write(root: Path, name: str, seeds: dict[int, dict[str, float]]):
    (root / name).mkdir(parents=True)
    state = {"model": name, "seeds": {str(k): v for k, v in seeds.items()}}
    (root / name / "scores.json").write_text(json.dumps(state))


def test_report_table_matches_the_metrics_by_hand(tmp_path):
    bench = mopd_metrics.learned_benchmarks(3)  # 9 benchmarks of the three-stage prefix
    base = {b: 40.0 for b in bench}
    experts = {d: {b: (60.0 if mopd_metrics.BENCHMARK_DOMAIN[b] == d else 40.0) for b in bench}
               for d in mopd_metrics.DOMAINS[:3]}
    seed0 = {b: 50.0 for b in bench}
    seed1 = {b: 52.0 for b in bench}
    _write(tmp_path, "base", {0: base})
    for d, s in experts.items():
        _write(tmp_path, f"expert_{d}", {0: s})
    _write(tmp_path, "model", {0: seed0, 1: seed1})
    runs = report.load_runs(tmp_path)
    header, rows = report.table_rows(runs, 3, "base", {d: f"expert_{d}" for d in experts})
    row = dict(zip(header, next(r for r in rows if r[0] == "model")))
    assert row["Avg"] == pytest.approx(51.0) and row["logic"] == pytest.approx(51.0)
    # Norm: gain 11 per benchmark over the best expert's 20 -> 0.55; Norm_dom: same per domain
    assert row["Norm"] == pytest.approx(0.55) and row["Norm_dom"] == pytest.approx(0.55) and row["seeds"] == 2
    # noise: one checkpoint with seeds 50 and 52 -> s = sqrt(2), 1 dof; half-width t_{.975,1}·s·sqrt(2/3)
    s, dof, hw = report.noise(runs, 3)
    assert (s, dof) == (pytest.approx(math.sqrt(2.0)), 1)
    assert hw == pytest.approx(12.7062047 * math.sqrt(2.0) * math.sqrt(2 / 3), rel=1e-6)
    md = report.markdown(runs, 3, "base", {d: f"expert_{d}" for d in experts})
    assert "| model | 51.00 | 51.00 | 51.00 | 51.00 | 0.550 | 0.550 | 2 |" in md


def test_report_bwt_from_stage_snapshots(tmp_path):
    b3 = mopd_metrics.learned_benchmarks(3)
    _write(tmp_path, "run/student_1", {0: {b: 50.0 for b in mopd_metrics.DOMAIN_BENCHMARKS["logic"]}})
    _write(tmp_path, "run/student_2", {0: {b: 45.0 for b in mopd_metrics.learned_benchmarks(2)}})
    _write(tmp_path, "run/student_3", {0: {**{b: 44.0 for b in b3}, "MuSR": 39.0}})
    runs = report.load_runs(tmp_path)
    names, vals = report.bwt_rows(runs, ["run/student_1", "run/student_2", "run/student_3"])
    got = dict(zip(names, vals))
    assert got["MuSR"] == pytest.approx(-11.0) and got["BBH"] == pytest.approx(-6.0)
    assert got["AIME24"] == pytest.approx(-1.0)
    # GEM: mean over the earlier domains of (final − when learned): logic (44+44+39)/3 − 50, math 44 − 45
    assert got["BWT_GEM"] == pytest.approx(((127 / 3 - 50) + (44 - 45)) / 2)
    with pytest.raises(ValueError, match="no scores"):
        report.table_rows(runs, 3, base="nope")


def test_model_argument_is_a_model_or_a_run_with_stage_snapshots(tmp_path):
    from claas_verl.mopd.eval.cli import _checkpoints

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert _checkpoints(str(tmp_path / "m"), None) == [("m", str(tmp_path / "m"))]
    for j in (2, 10, 1):
        (tmp_path / "run" / "snapshots" / f"student_{j}").mkdir(parents=True)
        (tmp_path / "run" / "snapshots" / f"student_{j}" / "config.json").write_text("{}")
    (tmp_path / "run" / "snapshots" / "student_3").mkdir()  # no config.json: an unfinished copy is skipped
    names = [n for n, _ in _checkpoints(str(tmp_path / "run"), None)]
    assert names == ["run/student_1", "run/student_2", "run/student_10"]
    with pytest.raises(ValueError, match="neither a Hugging Face model folder"):
        _checkpoints(str(tmp_path), None)


def test_report_bwt_skips_benchmarks_not_evaluated(tmp_path):
    _write(tmp_path, "r/s1", {0: {"BBH": 50.0, "GYM": 40.0}})
    _write(tmp_path, "r/s2", {0: {"BBH": 47.0, "AIME24": 10.0}})
    names, vals = report.bwt_rows(report.load_runs(tmp_path), ["r/s1", "r/s2"])
    assert names == ["BBH", "BWT_GEM"] and vals[0] == pytest.approx(-3.0) and math.isnan(vals[1])
