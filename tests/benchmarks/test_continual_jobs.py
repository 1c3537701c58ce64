"""How benchmarks/continual.py runs its jobs: --jobs N in parallel, every finished run saved at once, a failed run
reported after the others finished (exit 1) and retried by the same command, records of an older CLaaS stream
design dropped and rerun. The trainer job is replaced by a function returning a record: what is tested here is
the orchestration around it (the real jobs are tests/benchmarks/test_continual_claas.py::test_quick_claas_run_*)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import continual_claas as claas_bench  # noqa: E402  (the module continual.main imports)

from benchmarks import continual as bench  # noqa: E402

RECIPE = "claas/tiny_no_update"


def _record(recipe: str, seed: int, final: float) -> dict:
    M = [[final] * 5 for _ in range(5)]
    return {"recipe": recipe, "seed": seed, "kind": "claas", "design": claas_bench.DESIGN, "M": M,
            "stage_scores": {j + 1: {f"split_{k + 1}": final for k in range(5)} for j in range(5)},
            "final_avg": final, "forgetting": 0.0, "forward_transfer": final, "reward_curve": [], "updates": 0,
            "rollout_mean_reward": final, "seconds": 1.0}


def test_parallel_jobs_overlap_and_a_failure_loses_no_other_run(tmp_path, monkeypatch, capsys):
    both_in_flight = threading.Barrier(2, timeout=60)
    calls = []

    def job(recipe, seed, out, quick, extra, stream):
        calls.append(seed)
        both_in_flight.wait()  # raises BrokenBarrierError unless the two jobs really run at the same time
        if seed == 2:
            raise RuntimeError("the trainer job died")
        return _record(recipe, seed, 0.25)

    monkeypatch.setattr(claas_bench, "claas_run", job)
    rc = bench.main(["--recipes", RECIPE, "--seeds", "1,2", "--jobs", "2", "--out", str(tmp_path)])
    assert rc == 1 and sorted(calls) == [1, 2]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [(r["recipe"], r["seed"]) for r in saved["runs"]] == [(RECIPE, 1)]  # the finished run is kept
    err = capsys.readouterr().err
    assert f"{RECIPE} seed 2 FAILED: the trainer job died" in err and "run the same command again" in err

    # the same command again runs only the failed seed
    calls.clear()
    monkeypatch.setattr(claas_bench, "claas_run",
                        lambda recipe, seed, *a: calls.append(seed) or _record(recipe, seed, 0.75))
    assert bench.main(["--recipes", RECIPE, "--seeds", "1,2", "--jobs", "2", "--out", str(tmp_path)]) == 0
    assert calls == [2]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["seed"], r["final_avg"]) for r in saved["runs"]) == [(1, 0.25), (2, 0.75)]
    assert saved["summary"][RECIPE]["final_avg"][0] == pytest.approx(0.5)
    assert (tmp_path / "report.md").exists()


def test_claas_records_of_an_older_stream_design_are_run_again(tmp_path, monkeypatch):
    old = _record(RECIPE, 1, 0.9)
    del old["design"]  # written before the grouped stream (DESIGN 2)
    (tmp_path / "results.json").write_text(json.dumps({"runs": [old]}))
    calls = []
    monkeypatch.setattr(claas_bench, "claas_run",
                        lambda recipe, seed, *a: calls.append(seed) or _record(recipe, seed, 0.1))
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert calls == [1]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["seed"], r["final_avg"], r["design"]) for r in runs] == [(1, 0.1, claas_bench.DESIGN)]


def test_jobs_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--recipes", RECIPE, "--jobs", "0", "--out", str(tmp_path)])


def test_saved_records_count_only_for_the_command_that_made_them():
    bundles = {"mopd": "gym-fp", "claas": "tiny-fp"}
    full_mopd = {"kind": "mopd", "quick": False, "eval_version": bench.EVAL_VERSION,  # written before "overrides"
                 "bundle_fingerprint": "gym-fp"}
    assert bench.current_record(full_mopd, quick=False, extra=[], bundles=bundles)
    assert not bench.current_record(full_mopd, quick=False, extra=["mopd.domains.spell.num_blocks=4"], bundles=bundles)
    assert not bench.current_record(full_mopd, quick=True, extra=[], bundles=bundles)
    # a quick record of the old 3-domain plan is not a run of today's 2-domain --quick
    old_quick = dict(full_mopd, quick=True)
    assert not bench.current_record(old_quick, quick=True, extra=[], bundles=bundles)
    new_quick = dict(old_quick, overrides=bench.run_extra(True, []))
    assert bench.current_record(new_quick, quick=True, extra=[], bundles=bundles)
    assert not bench.current_record(dict(full_mopd, eval_version=1), quick=False, extra=[], bundles=bundles)
    claas = dict(_record(RECIPE, 1, 0.5), bundle_fingerprint="tiny-fp")
    assert bench.current_record(claas, quick=False, extra=[], bundles=bundles)
    assert not bench.current_record(claas, quick=False, extra=["claas.m=8"], bundles=bundles)
    assert bench.current_record(dict(claas, overrides=["claas.m=8"]), quick=False, extra=["claas.m=8"], bundles=bundles)


def test_a_record_counts_only_for_the_bundle_it_was_made_with():
    """After a rebuild (another bundle version, seed or directory) a saved run is not this command's run; records
    without a fingerprint (written before it was kept) are not trusted either; a kind this command does not run
    is left as it is."""
    mopd = {"kind": "mopd", "quick": False, "eval_version": bench.EVAL_VERSION, "overrides": [],
            "bundle_fingerprint": "gym-a"}
    assert bench.current_record(mopd, quick=False, extra=[], bundles={"mopd": "gym-a"})
    assert not bench.current_record(mopd, quick=False, extra=[], bundles={"mopd": "gym-b"})
    assert not bench.current_record({k: v for k, v in mopd.items() if k != "bundle_fingerprint"}, quick=False,
                                extra=[], bundles={"mopd": "gym-a"})
    claas = dict(_record(RECIPE, 1, 0.5), bundle_fingerprint="tiny-a")
    assert not bench.current_record(claas, quick=False, extra=[], bundles={"claas": "tiny-b"})
    assert bench.current_record(claas, quick=False, extra=[], bundles={"mopd": "gym-a"})


def test_a_rebuilt_bundle_reruns_the_saved_runs(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(claas_bench, "claas_run",
                        lambda recipe, seed, *a: calls.append(seed) or _record(recipe, seed, 0.3))
    monkeypatch.setattr(bench, "bundle_fingerprints", lambda recipes: {"claas": "tiny-a"})
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path)]) == 0  # same bundle: reused
    assert calls == [1]
    monkeypatch.setattr(bench, "bundle_fingerprints", lambda recipes: {"claas": "tiny-b"})
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert calls == [1, 1]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["seed"], r["bundle_fingerprint"]) for r in runs] == [(1, "tiny-b")]


def test_a_rerun_with_other_overrides_replaces_the_saved_records(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(claas_bench, "claas_run", lambda recipe, seed, out, quick, extra, stream: calls.append(extra) or
                        dict(_record(recipe, seed, 0.2 if extra else 0.1), overrides=list(extra)))
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path), "claas.m=8"]) == 0
    assert calls == [[], ["claas.m=8"]]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["final_avg"], r["overrides"]) for r in runs] == [(0.2, ["claas.m=8"])]


def test_claas_runs_train_on_the_tiny_bundle_they_fingerprint(tiny, monkeypatch):
    """The CLaaS half builds the tiny bundle when missing (ensure_tiny; a fresh machine's jobs used to fail
    asking for `python -m claas_verl.tiny make`) and exports its directory to the trainer jobs."""
    from claas_verl.tiny.fingerprint import bundle_fingerprint

    monkeypatch.setenv("CLAAS_TINY_DIR", str(tiny.root))
    fps = bench.bundle_fingerprints([RECIPE])
    assert fps == {"claas": bundle_fingerprint(tiny.root)}
    assert bench.os.environ["CLAAS_TINY_DIR"] == str(tiny.root)


@pytest.mark.parametrize(("args", "says"), [
    (["--seeds", "1,2,1"], "--seeds: 1 given more than once"),
    (["--recipes", f"{RECIPE},{RECIPE}"], f"--recipes: {RECIPE} given more than once"),
    (["--seeds", "-1"], "seeds are non-negative"),
    (["--seeds", ""], "expected comma-separated integers"),
    (["--seeds", "1,x"], "expected comma-separated integers"),
    (["--recipes", "mopd/gym_sequential"], "no such recipe"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys, args, says):
    def no_job(*a, **k):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(bench, "bundle_fingerprints", no_job)
    monkeypatch.setattr(claas_bench, "claas_run", no_job)
    argv = ["--recipes", RECIPE, *args] if "--recipes" not in args else args
    with pytest.raises(SystemExit) as exc:
        bench.main([*argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_second_benchmark_on_the_same_out_is_refused(tmp_path, monkeypatch, capsys):
    """Started twice on one --out (an operator restarting while the first still runs): the second is refused at
    once, naming the lock, and the first one's directory is untouched; once the first ends, the command runs."""
    import subprocess

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(  # the first benchmark: another process holding the directory's lock
        [sys.executable, "-c", "import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); "
         "l.acquire(); print('held', flush=True); time.sleep(60)", str(out / ".benchmark.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(claas_bench, "claas_run", lambda *a: pytest.fail("the second benchmark may not run a job"))
        monkeypatch.setattr(bench, "bundle_fingerprints", lambda recipes: {"claas": "tiny-a"})
        with pytest.raises(SystemExit) as exc:
            bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(out)])
        assert exc.value.code == 2 and "another benchmark is running" in capsys.readouterr().err
        assert not (out / "results.json").exists()
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setattr(claas_bench, "claas_run", lambda recipe, seed, *a: _record(recipe, seed, 0.4))
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(out)]) == 0


@pytest.mark.parametrize(("content", "says"), [
    ('{"runs": [{"recipe": "claas/tiny_no_update", "se', "is not valid JSON"),
    ('[1, 2]', 'has no "runs" list'),
])
def test_a_damaged_results_file_is_refused_and_kept(tmp_path, monkeypatch, capsys, content, says):
    monkeypatch.setattr(claas_bench, "claas_run", lambda *a: pytest.fail("nothing may run"))
    (tmp_path / "results.json").write_text(content)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path)])
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == content


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit):
        bench.main(["--recipes", RECIPE, "--out", str(tmp_path / "f")])
    assert "a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "mopd_seeds", "claas_seeds"), [
    ([], [1, 2, 3], [3, 4, 5]),  # CLaaS's stream was designed on seeds 1-2: its default runs never use them
    (["--quick"], [1], [3]),
    (["--seeds", "7,8"], [7, 8], [7, 8]),
])
def test_default_seeds_per_kind(tmp_path, monkeypatch, args, mopd_seeds, claas_seeds):
    ran = []
    monkeypatch.setattr(bench, "bundle_fingerprints", lambda recipes: {"mopd": "gym-a", "claas": "tiny-a"})
    monkeypatch.setattr(bench, "gym_manifest", lambda: {k: {} for k in ("domains", "accuracy", "accuracy_protocol",
                                                                    "sizes")})
    monkeypatch.setattr(claas_bench, "claas_run", lambda recipe, seed, *a: ran.append((recipe, seed)) or
                        _record(recipe, seed, 0.5))
    def mopd_job(recipe, seed, *a):
        ran.append((recipe, seed))
        raise RuntimeError("not trained here: only which seeds were started is checked")

    monkeypatch.setattr(bench, "mopd_run", mopd_job)
    # the MOPD runs "failed"
    assert bench.main(["--recipes", f"mopd/gym_seq,{RECIPE}", *args, "--out", str(tmp_path)]) == 1
    assert sorted(s for r, s in ran if r == "mopd/gym_seq") == mopd_seeds
    assert sorted(s for r, s in ran if r == RECIPE) == claas_seeds


def test_claas_stream_option_reaches_the_runs_and_other_streams_rerun(tmp_path, monkeypatch):

    assert set(claas_bench.STREAMS) == {"contradictory", "compatible"}  # the option's choices
    (tmp_path / "results.json").write_text(json.dumps({"runs": [_record(RECIPE, 1, 0.9)]}))  # default stream
    calls = []

    def job(recipe, seed, out, quick, extra, stream):
        calls.append((seed, stream))
        return dict(_record(recipe, seed, 0.4), stream=stream)

    monkeypatch.setattr(claas_bench, "claas_run", job)
    assert bench.main(["--recipes", RECIPE, "--seeds", "1", "--out", str(tmp_path),
                       "--claas-stream", "compatible"]) == 0
    assert calls == [(1, "compatible")]  # the default stream's record is not this command's run
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [(r["final_avg"], r["stream"]) for r in saved["runs"]] == [(0.4, "compatible")]
    assert "3 (end_punctuation)" in (tmp_path / "report.md").read_text()
    rec = saved["runs"][0]
    assert bench.current_record(rec, quick=False, extra=[], bundles={}, stream="compatible")
    assert not bench.current_record(rec, quick=False, extra=[], bundles={})
    with pytest.raises(SystemExit):
        bench.main(["--recipes", RECIPE, "--out", str(tmp_path), "--claas-stream", "mixed"])
