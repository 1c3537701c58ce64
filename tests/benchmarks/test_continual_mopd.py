"""The MOPD half of the continual benchmark (benchmarks/continual.py): what it scores for each recipe, read from
the recipe's own plan and evaluation settings composed as the trainer composes them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import continual as bench  # noqa: E402
from benchmarks import continual_report as report  # noqa: E402

ALL = ["reverse", "spell", "palin"]


def test_staged_recipe_scores_every_stage_end_on_the_domains_learned_so_far():
    m = bench.recipe_stages("mopd/gym_seq", [])
    assert m["order"] == ALL and m["staged"]
    assert m["stage_domains"] == {1: ["reverse"], 2: ["reverse", "spell"], 3: ALL}
    # the gym data group's evaluation size and the training rollouts' sampling
    assert m["eval"] == {"prompts": 48, "samples": 4, "max_new_tokens": 40, "temperature": 1.0}


def test_recovery_is_one_more_scored_stage_and_joint_is_one_unstaged_stage():
    rec = bench.recipe_stages("mopd/gym_seq_recovery", [])
    assert rec["stage_domains"] == {1: ["reverse"], 2: ["reverse", "spell"], 3: ALL, 4: ALL} and rec["staged"]
    joint = bench.recipe_stages("mopd/gym_joint", [])
    assert joint["stage_domains"] == {1: ALL} and not joint["staged"]


def test_command_line_mopd_overrides_reach_the_scored_protocol_and_others_are_left_to_the_trainer():
    m = bench.recipe_stages("mopd/gym_replay_kl", ["mopd.order=[reverse,spell]", "mopd.domains.spell.num_blocks=8",
                                               "mopd.eval.prompts=8", "actor_rollout_ref.rollout.seed=3"])
    assert m["eval"]["prompts"] == 8
    assert m["order"] == ["reverse", "spell"] and m["stage_domains"] == {1: ["reverse"], 2: ["reverse", "spell"]}
    # --quick: every stage whole, as in the full run
    quick_stages = bench.recipe_stages("mopd/gym_replay_kl", bench.QUICK_MOPD_OVERRIDES)
    assert quick_stages == bench.recipe_stages("mopd/gym_replay_kl", [])
    full = bench.recipe_stages("mopd/gym_replay_kl", [])
    assert full["stage_domains"][3] == ALL
    with pytest.raises(ValueError, match="top_p"):
        bench.recipe_stages("mopd/gym_seq", ["mopd.train.top_p=0.9"])


def test_benchmark_jobs_skip_the_trainers_in_run_table():
    """The snapshots are scored once by the benchmark; the trainer's own table would sample them again."""
    assert "mopd.eval.enabled=false" in bench.RUN_OVERRIDES


@pytest.fixture(scope="module")
def fake_gym(tmp_path_factory):
    """A gym-shaped directory with tiny random models (π0, experts) and the real held-out rows."""
    from claas_verl.tiny import gym
    from claas_verl.tiny.model import build_student, save_model
    from claas_verl.tiny.tokenizer import EOT_TOKEN, IM_END, special_token_ids
    from claas_verl.utils.prompt_rows import write_parquet

    root = tmp_path_factory.mktemp("gym")
    tok = gym.byte_tokenizer()
    ids = special_token_ids(tok)

    def model(seed):
        return build_student(len(tok), [ids[IM_END], ids[EOT_TOKEN]], ids[EOT_TOKEN], seed)

    for i, d in enumerate(gym.GYM_DOMAINS):
        write_parquet(gym.gym_rows(d, seed=0)[1], root / "data" / d.name / "test.parquet")
        save_model(model(10 + i), tok, root / "experts" / d.name)
    save_model(model(0), tok, root / "student")
    return root, tok, model


def test_a_finished_run_is_scored_from_its_stage_snapshots(fake_gym, tmp_path, monkeypatch):
    """mopd_run on a finished job (no trainer run): every stage snapshot scored, references cached per seed, the
    record carries the protocol; forgetting and BWT follow from the snapshot scores."""
    from claas_verl.tiny.model import save_model

    root, tok, model = fake_gym
    monkeypatch.setenv("CLAAS_GYM_DIR", str(root))
    run = tmp_path / "runs" / bench.run_name("mopd/gym_seq", 1)
    for st in (1, 2, 3):
        save_model(model(100 + st), tok, run / "snapshots" / f"student_{st}")
    small = ["mopd.eval.prompts=2", "mopd.eval.responses_per_prompt=1"]
    cmd = bench.mopd_job_args("mopd/gym_seq", 1, False, small)
    (run / bench.FINISHED).write_text(bench.json.dumps({"seconds": 12.5, "cmd": cmd, "bundle_fingerprint": "gym-a"}))
    rec = bench.mopd_run("mopd/gym_seq", 1, tmp_path, False, small, "gym-a")
    assert rec["eval_version"] == bench.EVAL_VERSION and rec["seconds"] == 12.5 and rec["bundle_fingerprint"] == "gym-a"
    assert rec["eval"] == {"prompts": 2, "samples": 1, "max_new_tokens": 40, "temperature": 1.0}
    assert {st: sorted(row) for st, row in rec["stage_scores"].items()} == {
        1: ["reverse"], 2: ["reverse", "spell"], 3: sorted(ALL)}
    assert all(v > 0 for row in rec["kl_to_expert"].values() for v in row.values())  # random models differ
    ss = rec["stage_scores"]
    f_reverse = max(max(ss[1]["reverse"], ss[2]["reverse"]) - ss[3]["reverse"], 0.0)
    f_spell = max(ss[2]["spell"] - ss[3]["spell"], 0.0)
    assert rec["forgetting"] == pytest.approx((f_reverse + f_spell) / 2)
    assert rec["bwt"] == pytest.approx((ss[3]["reverse"] - ss[1]["reverse"] + ss[3]["spell"] - ss[2]["spell"]) / 2)
    assert rec["trainer_stage_scores"] == {}  # the job ran without the in-run table
    saved = bench.json.loads((tmp_path / "reference_scores.json").read_text())
    assert saved["bundle_fingerprint"] == "gym-a"
    refs = saved["scores"]
    assert list(refs) == [f"1:{bench.json.dumps(rec['eval'], sort_keys=True)}"]
    assert set(refs[next(iter(refs))]) == {"student", "expert:reverse", "expert:spell", "expert:palin"}
    # scoring is a pure function of (snapshot, seed, protocol): scoring again gives the same record
    assert bench.mopd_run("mopd/gym_seq", 1, tmp_path, False, small, "gym-a")["stage_scores"] == rec["stage_scores"]

    # another bundle: the finished job is not this bundle's run (it trained against other experts), so it is rerun
    # from scratch, and the cached references of the old bundle are not used
    class Rerun(Exception):
        pass

    def job(cmd, env, log, echo):
        assert not run.exists()  # the old run directory was removed first
        raise Rerun

    def no_scoring(*args, **kwargs):
        raise Rerun

    monkeypatch.setattr(bench, "run_job", job)
    with pytest.raises(Rerun):
        bench.mopd_run("mopd/gym_seq", 1, tmp_path, False, small, "gym-b")
    run.mkdir(parents=True)
    (run / bench.FINISHED).write_text('{"seconds": 12.5, "cmd": [')  # a marker cut short: the run is done again
    with pytest.raises(Rerun):
        bench.mopd_run("mopd/gym_seq", 1, tmp_path, False, small, "gym-a")
    monkeypatch.setattr(bench, "_score", no_scoring)
    table = refs[next(iter(refs))]
    assert bench.reference_scores(tmp_path, 1, rec["eval"], "gym-a") == table  # cached: no model is scored
    with pytest.raises(Rerun):  # the cache of bundle gym-a does not answer for gym-b
        bench.reference_scores(tmp_path, 1, rec["eval"], "gym-b")
    (tmp_path / "reference_scores.json").write_text('{"bundle_fingerprint": "gym-a", "sco')  # a damaged cache
    with pytest.raises(Rerun):  # is scored again, not a crash
        bench.reference_scores(tmp_path, 1, rec["eval"], "gym-a")


def test_a_finished_run_without_its_snapshot_is_refused(fake_gym, tmp_path, monkeypatch):
    root, tok, model = fake_gym
    monkeypatch.setenv("CLAAS_GYM_DIR", str(root))
    run = tmp_path / "runs" / bench.run_name("mopd/gym_seq", 1)
    from claas_verl.tiny.model import save_model

    for st in (1, 3):
        save_model(model(100 + st), tok, run / "snapshots" / f"student_{st}")
    small = ["mopd.eval.prompts=2", "mopd.eval.responses_per_prompt=1"]
    cmd = bench.mopd_job_args("mopd/gym_seq", 1, False, small)
    (run / bench.FINISHED).write_text(bench.json.dumps({"seconds": 1.0, "cmd": cmd, "bundle_fingerprint": "gym-a"}))
    with pytest.raises(FileNotFoundError, match="stage-2 snapshot"):
        bench.mopd_run("mopd/gym_seq", 1, tmp_path, False, small, "gym-a")


def test_report_names_the_domains_the_runs_learned():
    """A plan cut to two domains learns those only: the report's title, reference table and stage tables say so."""
    from claas_verl.metrics import benchmark as stats

    stage_scores = {1: {"reverse": 0.3}, 2: {"reverse": 0.2, "spell": 0.0}}
    ref = {"student": {"reverse": 0.25, "spell": 0.0, "palin": 0.07},
           "expert:reverse": {"reverse": 0.99, "spell": 0.0, "palin": 0.0},
           "expert:spell": {"reverse": 0.06, "spell": 0.65, "palin": 0.0},
           "expert:palin": {"reverse": 0.0, "spell": 0.0, "palin": 0.39}}
    metrics = stats.run_metrics(stage_scores, ["reverse", "spell"], staged=True, base=ref["student"],
                            experts={k: v for k, v in ref.items() if k.startswith("expert:")})
    run = {"recipe": "mopd/gym_seq", "seed": 1, "order": ["reverse", "spell"], "stage_scores": stage_scores,
           "kl_to_expert": {1: {"reverse": 4.0}, 2: {"reverse": 5.0, "spell": 3.0}}, **metrics,
           "eval": {"prompts": 48, "samples": 4, "max_new_tokens": 40, "temperature": 1.0}}
    results = {"summary": stats.summarize([run]), "references": {"1:{}": ref}}
    text = "\n".join(report.mopd_report([run], results))
    assert "## MOPD: two reasoning-gym domains, reverse → spell" in text
    assert "| model | reverse | spell |" in text and "expert:palin" not in text
    assert "| 2 | 0.200 (5.000) | 0.000 (3.000) |" in text
    # what each stage taught, beside the forgetting, with π0 and the best expert as reference rows
    assert "| method | gain on reverse | gain on spell | smallest gain | forgetting |" in text
    assert "| Seq | 0.050 | 0.000 | 0.000 | 0.100 |" in text
    assert "| π0 (accuracy) | 0.250 | 0.000 | | |" in text and "| best expert (accuracy) | 0.990 | 0.650 | | |" in text
    assert metrics["forgetting"] == pytest.approx(0.1)
    # seeds are listed in numeric order ("10" used to come before "4")
    runs = [dict(run, seed=seed) for seed in (10, 4, 9)]
    results["references"] = {f"{seed}:{{}}": ref for seed in (10, 4, 9)}
    assert "mean over seeds 4, 9, 10):" in "\n".join(report.mopd_report(runs, results))
    # a run with no command-line override says nothing about overrides
    assert "overrides" not in text


def test_report_names_the_command_line_overrides_of_its_runs(monkeypatch):
    """The method labels name recipes: runs made with ``mopd.train.replay_std_floor=0.3`` on the command line must
    not read as the recipes as written (the committed floor runs of fixed share and FSAR did)."""
    from claas_verl.metrics import benchmark as stats

    stage_scores = {1: {"reverse": 0.3}, 2: {"reverse": 0.2, "spell": 0.5}}
    metrics = stats.run_metrics(stage_scores, ["reverse", "spell"], staged=True, base={"reverse": 0.0, "spell": 0.0},
                            experts={"expert:reverse": {"reverse": 0.9, "spell": 0.1},
                                     "expert:spell": {"reverse": 0.1, "spell": 0.9}})
    base = {"seed": 1, "order": ["reverse", "spell"], "stage_scores": stage_scores, "kl_to_expert": {
        1: {"reverse": 1.0}, 2: {"reverse": 1.0, "spell": 1.0}}, **metrics, "eval": {}, "quick": False}
    floor = ["mopd.train.replay_std_floor=0.3"]
    runs = [dict(base, recipe=r, overrides=floor) for r in ("mopd/gym_replay_kl_fixed", "mopd/gym_fsar_shared")]
    results = {"summary": stats.summarize(runs), "references": {}}
    text = "\n".join(report.mopd_report(runs, results))
    assert "Run with the command-line overrides `mopd.train.replay_std_floor=0.3` (every run)." in text
    # runs of one results file with different overrides name their recipes
    mixed = [runs[0], dict(base, recipe="mopd/gym_seq", overrides=[])]
    text = "\n".join(report.mopd_report(mixed, {"summary": stats.summarize(mixed), "references": {}}))
    assert "`mopd.train.replay_std_floor=0.3` (`mopd/gym_replay_kl_fixed`)." in text
    # ... and their seeds when only some runs of a recipe had them
    mixed.append(dict(runs[0], seed=2, overrides=[]))
    text = "\n".join(report.mopd_report(mixed, {"summary": stats.summarize(mixed), "references": {}}))
    assert "`mopd.train.replay_std_floor=0.3` (`mopd/gym_replay_kl_fixed` seed 1)." in text
    # a quick run's own plan overrides are the mode's, not the user's
    for module in (bench, report):  # the runner records them, the report leaves them out
        monkeypatch.setattr(module, "QUICK_MOPD_OVERRIDES", ["mopd.domains.reverse.num_blocks=8"])
    quick = [dict(base, recipe="mopd/gym_seq", quick=True, overrides=bench.run_extra(True, []))]
    lines = report.mopd_report(quick, {"summary": stats.summarize(quick), "references": {}})
    assert "overrides" not in "\n".join(lines)


def test_the_console_shows_each_stage_of_a_job():
    """The benchmark echoes the trainer's stage lines (it showed nothing for whole jobs once the in-run table was
    turned off: it waited for the evaluation's lines only)."""
    import inspect

    from claas_verl.mopd.trainer import snapshots, teachers

    assert '"[mopd] stage {stage} begins at global step {global_steps}: ' in inspect.getsource(teachers)
    assert '"[mopd] stage {stage} ends: snapshot M_{stage} -> {dst}"' in inspect.getsource(snapshots)
    prefix = "\x1b[36m(MOPDTaskRunner pid=4566)\x1b[0m "
    assert bench._echo(prefix + "[mopd] stage 2 begins at global step 13: teachers {'spell': '/x'}\n") == \
        "stage 2 begins at global step 13"
    assert bench._echo(prefix + "[mopd] stage 2 ends: snapshot M_2 -> /runs/s/snapshots/student_2\n") == \
        "stage 2 ends: snapshot M_2 -> /runs/s/snapshots/student_2"
    assert bench._echo(prefix + "[mopd] stage 1 end: KL(student || E[reverse]) = 4.6 (binned 4.1), score 0.310") == \
        "stage 1 end: KL(student || E[reverse]) = 4.6 (binned 4.1), score 0.310"
    assert bench._echo(prefix + "[mopd] step 3/36 stage 1/3: 3/12 steps (25%), 0:09 elapsed, "
                   "ETA 0:27 | new reverse block 2 teacher expert:reverse, kl_topk 0.1, sigma 1") is None
    assert bench._echo("step:1 - global_seqlen/min:4928.0") is None


def test_report_only_recomputes_metrics_from_stored_scores_and_runs_nothing(tmp_path):
    """``--report-only`` on a copy of the committed results: the same metrics, the stage gains added, the report
    rewritten; no bundle is built and no job starts (a missing reference is refused naming the run)."""
    import json
    import shutil

    committed = bench.Path(bench.__file__).resolve().parent / "results" / "continual_mopd"
    out = tmp_path / "copy"
    shutil.copytree(committed, out)
    before = json.loads((out / "results.json").read_text())
    for r in before["runs"]:
        r.pop("stage_gain", None), r.pop("min_stage_gain", None)
    (out / "results.json").write_text(json.dumps(before))
    assert bench.main(["--report-only", "--out", str(out)]) == 0
    after = json.loads((out / "results.json").read_text())
    for a, b in zip(before["runs"], after["runs"]):
        assert {k: b[k] for k in a} == a
        assert set(b["stage_gain"]) == set(b["order"]) and b["min_stage_gain"] == min(b["stage_gain"].values())
    gains = " | ".join(f"gain on {d}" for d in before["runs"][0]["order"])
    assert f"| method | {gains} | smallest gain | forgetting |" in (out / "report.md").read_text()
    assert not (out / "runs").exists()
    after["references"] = {}
    (out / "results.json").write_text(json.dumps(after))
    with pytest.raises(ValueError, match="no stored π0/expert scores for mopd/gym_seq seed 1"):
        bench.main(["--report-only", "--out", str(out)])


def test_keep_step_logs_copies_each_runs_step_log_gzipped_and_byte_stable(tmp_path):
    # --keep-step-logs: runs/<run>/steps.jsonl -> steps/<run>.jsonl.gz (the plan's committed per-step log); the gzip
    # header carries no time, so copying the same log twice gives the same bytes (a rerun adds no diff)
    import gzip

    name = bench.run_name("mopd/gym_replay_kl", 31)
    log = b'{"stage": 1, "kind": "new", "global_step": 1, "metrics": {"mopd/update_norm": 0.4}}\n'
    (tmp_path / "runs" / name).mkdir(parents=True)
    (tmp_path / "runs" / name / "steps.jsonl").write_bytes(log)
    kept = bench.keep_step_log(tmp_path, "mopd/gym_replay_kl", 31)
    assert kept == tmp_path / "steps" / f"{name}.jsonl.gz"
    assert gzip.decompress(kept.read_bytes()) == log
    first = kept.read_bytes()
    assert bench.keep_step_log(tmp_path, "mopd/gym_replay_kl", 31).read_bytes() == first
    assert bench.keep_step_log(tmp_path, "mopd/gym_seq", 31) is None  # no run directory, no log
