"""Continual-learning benchmark on CPU: MOPD schedules and CLaaS algorithms, each run through its real trainer.

    python benchmarks/continual.py --recipes mopd/gym_seq,mopd/gym_replay_kl --seeds 1,2,3 --out DIR
    python benchmarks/continual.py --quick --out DIR          # the reduced comparison (`make demo`)

Every method is a Hydra recipe and its overrides, run as its own job (``python -m claas_verl.main_mopd`` or
``python -m claas_verl.main_claas``). ``--recipes`` takes the methods' names (``benchmarks/continual_methods.py``
maps each to its spelling: ``mopd/gym_seq`` is ``mopd/seq scale=gym``) or any recipe under recipes/, run as
written; ``key=value`` arguments after the options go to every run. Outputs in DIR:

* ``results.json``: ``{"runs": [{"recipe", "seed", "stage_scores": {stage: {domain: accuracy}}, "final_avg",
  "forgetting", ...}], "summary": {recipe: {"final_avg": [mean, half_width], "forgetting": [...], ...}}}``,
  half-widths of the 95% interval of the mean over seeds (``claas_verl.metrics.benchmark``);
* ``report.md``: the tables; ``*.png``: per-domain accuracy across stages for each method, final accuracy and
  forgetting with error bars (and the CLaaS plots, ``benchmarks/continual_claas.py``);
* ``runs/<recipe>_s<seed>/``: each run's own outputs (``steps.jsonl``, ``forgetting.jsonl``, snapshots);
* with ``--keep-step-logs``: ``steps/<recipe>_s<seed>.jsonl.gz``, each MOPD run's ``steps.jsonl`` gzipped (a few kB,
  small enough to commit with the results, unlike ``runs/``).

A run whose record is already in ``results.json`` is not run again: a benchmark killed half-way resumes where it
stopped when started again with the same ``--out``. A record counts only for the bundle it was made with: each
carries its bundle's fingerprint (``claas_verl/tiny/fingerprint.py``), and after a rebuild (another bundle
version, seed or ``CLAAS_GYM_DIR`` / ``CLAAS_TINY_DIR``) its run is done again. ``--jobs N`` runs N trainer
jobs at once (each its own Ray cluster; scoring stays one at a time, since the scorer seeds torch's global
generator); a job that fails is reported at the end, after the others finished, and the exit status is 1.

CLaaS methods use the tiny bundle (``claas_verl/tiny/build.py``, built on first use, under a minute;
``--claas-stream`` picks their rule stream). MOPD methods use the reasoning-gym bundle (``claas_verl/tiny/gym.py``,
built on first use, about 45 minutes on 2 CPU cores): the domains ``reverse``, ``spell`` and ``palin`` in that stage
order. Every stage-final snapshot the trainer saves (``snapshots/student_<stage>``), π0 and the experts are scored
by one evaluator (``claas_verl/mopd/eval/gym_snapshots.py``): reasoning-gym's own scorers on the recipe's 48
held-out prompts × 4 samples at τ = 1, and the exact full-vocabulary KL to each domain's expert on those samples.
The seed sets the rollout sampling and the evaluation samples; the bundle (π0, experts, data) is the same for every
seed. Each method is also compared with Seq seed by seed (``results.json`` ``paired``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_jobs import job_env, run_job, stopping_jobs_on_signals, tagged  # noqa: E402
from benchmarks.continual_methods import QUICK_MOPD_OVERRIDES, SPELLINGS, config_name, method_overrides  # noqa: E402
from benchmarks.continual_report import _fmt, aggregate, stored_references, summarize, write_report  # noqa: E402
from benchmarks.host import host_signature  # noqa: E402
from claas_verl.metrics import benchmark as stats  # noqa: E402  (pure python)

MOPD_FULL = ("mopd/gym_seq", "mopd/gym_replay_kl", "mopd/gym_replay_kl_floor", "mopd/gym_replay_kl_experts",
             "mopd/gym_replay_kl_fixed", "mopd/gym_seq_recovery", "mopd/gym_fsar_shared", "mopd/gym_joint")
MOPD_QUICK = ("mopd/gym_seq", "mopd/gym_replay_kl", "mopd/gym_replay_kl_floor")
CLAAS_FULL = ("claas/tiny_reinforce_pp", "claas/tiny_ppo", "claas/tiny_sdpo", "claas/tiny_icl",
              "claas/tiny_no_update")
# 2: every stage-final snapshot scored by claas_verl.mopd.eval.gym_snapshots (48 prompts x 4 samples, exact
# full-vocabulary KL). Records without it came from the trainer's in-run table, which the CPU runtime group cut to
# 4 prompts (recipes/mopd/common/base.yaml): they are scored again, not rerun.
EVAL_VERSION = 2
FINISHED = ".benchmark_finished"  # written in a run's directory when its trainer job exited 0
# mopd.eval.enabled=false: the snapshots are scored here (score_stage_snapshots), once, by one evaluator; the
# trainer's in-run table would sample the same prompts again through the rollout (minutes per run on 2 cores).
RUN_OVERRIDES = ["trainer.save_freq=-1", "trainer.resume_mode=disable", "mopd.eval.enabled=false"]
# Seeds when --seeds is not given. The CLaaS stream was designed on seeds 1-2 (benchmarks/continual_claas.py), so
# its reported runs use 3-5; MOPD's 1-3 (seed 1 was looked at while choosing kappa and the evaluation size).
DEFAULT_SEEDS = {"mopd": [1, 2, 3], "claas": [3, 4, 5]}
QUICK_SEEDS = {"mopd": [1], "claas": [3]}
# The snapshot scorer seeds torch's global generator (claas_verl.mopd.eval.gym_snapshots): with --jobs > 1, two runs
# scoring at once would draw from one generator and neither score would be reproducible. Jobs run in parallel;
# scoring, a small part of each run's time, takes this lock.
_SCORING = threading.Lock()


def run_name(recipe: str, seed: int) -> str:
    return f"{recipe.replace('/', '_')}_s{seed}"


def _echo(line: str) -> str | None:
    """The job's progress worth a line on the console: each stage's start and end (the trainer's
    ``[mopd] stage N begins at global step S: teachers ...`` / ``[mopd] stage N ends: snapshot ...``) and, when the
    in-run table is on, its stage-end evaluations (``[mopd] stage N start|end: KL ...``)."""
    if "[mopd] stage" not in line:
        return None
    msg = line.split("[mopd]", 1)[1].strip()
    if " begins at global step " in msg:
        return msg.split(":", 1)[0]  # the teachers' paths are in the log
    if " ends: " in msg or " start: " in msg or " end: " in msg:
        return msg
    return None


def gym_manifest() -> dict:
    from claas_verl.tiny.gym import ensure_gym

    paths = ensure_gym()
    os.environ["CLAAS_GYM_DIR"] = str(paths.root)
    return json.loads(paths.manifest.read_text())


def bundle_fingerprints(recipes: list[str]) -> dict[str, str]:
    """``{kind: fingerprint}`` of the bundle each kind of run trains on, built first when missing: the gym bundle
    for ``mopd/*`` recipes, the tiny bundle for ``claas/*`` ones. Their directories are exported
    (``CLAAS_GYM_DIR``, ``CLAAS_TINY_DIR``) so that the trainer jobs read the bundle that was fingerprinted."""
    from claas_verl.tiny.fingerprint import bundle_fingerprint

    out = {}
    if any(r.startswith("mopd/") for r in recipes):
        gym_manifest()
        out["mopd"] = bundle_fingerprint(os.environ["CLAAS_GYM_DIR"])
    if any(r.startswith("claas/") for r in recipes):
        from claas_verl.tiny import ensure_tiny

        tiny = ensure_tiny()
        os.environ["CLAAS_TINY_DIR"] = str(tiny.root)
        out["claas"] = bundle_fingerprint(tiny.root)
    return out


def run_extra(quick: bool, extra: list[str]) -> list[str]:
    """The overrides that make a MOPD run of this mode differ from the recipe's own (beyond name and seed)."""
    return [*(QUICK_MOPD_OVERRIDES if quick else []), *extra]


# Records written before they carried their overrides: the full runs had none, the quick ones a 3-domain plan.
LEGACY_QUICK_OVERRIDES = ["mopd.domains.reverse.num_blocks=8", "mopd.domains.arith.num_blocks=2"]


def current_record(r: dict, quick: bool, extra: list[str], bundles: dict, stream: str = "contradictory") -> bool:
    """Whether a saved record is a run of this command: same bundle (``bundles``: fingerprint per kind), same
    evaluation (MOPD) or stream design and ``--claas-stream`` (CLaaS), and the same overrides. Others are scored
    again from their run directories when the job was the same (same command, same bundle), else rerun."""
    from continual_claas import DESIGN as CLAAS_DESIGN

    kind = r.get("kind", "mopd")
    if kind in bundles and r.get("bundle_fingerprint") != bundles[kind]:
        return False  # (records of a kind this command does not run are left as they are)
    if r.get("kind") == "claas":
        return r.get("design") == CLAAS_DESIGN and r.get("overrides", []) == list(extra) \
            and bool(r.get("quick")) == quick and r.get("stream", "contradictory") == stream
    legacy = LEGACY_QUICK_OVERRIDES if r.get("quick") else []
    return (r.get("eval_version") == EVAL_VERSION and bool(r.get("quick")) == quick
            and r.get("overrides", legacy) == run_extra(quick, extra))


def mopd_job_args(recipe: str, seed: int, quick: bool, extra: list[str]) -> list[str]:
    """The trainer job's arguments after the interpreter (also what a run directory's FINISHED marker records)."""
    return ["-m", "claas_verl.main_mopd", f"--config-name={config_name(recipe)}", *method_overrides(recipe),
            f"trainer.experiment_name={run_name(recipe, seed)}", f"actor_rollout_ref.rollout.seed={seed}",
            f"actor_rollout_ref.actor.data_loader_seed={seed}", *RUN_OVERRIDES, *run_extra(quick, extra)]


def mopd_run(recipe: str, seed: int, out: Path, quick: bool, extra: list[str], bundle: str) -> dict:
    """One MOPD method under one seed through ``python -m claas_verl.main_mopd`` on the gym bundle whose
    fingerprint is ``bundle`` (``$CLAAS_GYM_DIR``); returns its run record."""
    name = run_name(recipe, seed)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *mopd_job_args(recipe, seed, quick, extra)]
    finished = runs / name / FINISHED
    try:
        marker = json.loads(finished.read_text())
    except (OSError, ValueError):  # none (not finished), or damaged: the run is done again
        marker = {}
    if isinstance(marker, dict) and marker.get("cmd") == cmd[1:] and marker.get("bundle_fingerprint") == bundle:
        # the same job ended but its record was not saved (a kill or an error while scoring)
        seconds = float(marker["seconds"])
    else:
        if (runs / name).exists():  # killed half-way, or run with other overrides or bundle: start from scratch
            shutil.rmtree(runs / name)
        seconds = run_job(cmd, job_env(CLAAS_OUT_DIR=str(runs)), runs / f"{name}.log", tagged(name, _echo))
        finished.write_text(json.dumps({"seconds": seconds, "cmd": cmd[1:], "bundle_fingerprint": bundle}) + "\n")
    with _SCORING:
        return _score_run(recipe, seed, out, quick, extra, seconds, bundle)


def _score_run(recipe: str, seed: int, out: Path, quick: bool, extra: list[str], seconds: float,
               bundle: str) -> dict:
    from claas_verl.mopd.trainer.forgetting_table import read_forgetting, stage_end_rows

    name = run_name(recipe, seed)
    runs = out / "runs"
    # the trainer's own stage-end table, when the job kept it (mopd.eval.enabled): a cross-check of the scorer
    trainer_scores: dict[int, dict[str, float]] = {}
    for r in stage_end_rows(read_forgetting(str(runs / name))):
        trainer_scores.setdefault(int(r["stage"]), {})[r["domain"]] = float(r["score"])
    method = recipe_stages(recipe, [*(QUICK_MOPD_OVERRIDES if quick else []), *extra])
    protocol = method["eval"]
    stage_scores, full_kl = score_stage_snapshots(runs / name, method["stage_domains"], seed, protocol)
    refs = reference_scores(out, seed, protocol, bundle)
    experts = {k: v for k, v in refs.items() if k.startswith("expert:")}
    metrics = stats.run_metrics(stage_scores, method["order"], staged=method["staged"], base=refs["student"],
                            experts=experts)
    return {"recipe": recipe, "seed": seed, "kind": "mopd", "quick": quick, "order": method["order"],
            "stage_scores": stage_scores, "kl_to_expert": full_kl, **metrics, "eval": protocol,
            "eval_version": EVAL_VERSION, "overrides": run_extra(quick, extra), "bundle_fingerprint": bundle,
            "trainer_stage_scores": trainer_scores, "run_dir": str(runs / name),
            "seconds": round(seconds, 1), "host": host_signature()}


def recipe_stages(recipe: str, overrides: list[str]) -> dict:
    """What the benchmark scores for a method (:mod:`benchmarks.continual_methods`), composed as the trainer
    composes it (``mopd.*`` overrides included): ``stage_domains`` {stage: domains learned by its end} from the
    recipe's plan, ``order`` (stage order),
    ``staged`` (False for joint MOPD), and ``eval``: prompts x samples of the stage-end evaluation and the
    sampling of the training rollouts (reply length, temperature)."""
    from hydra import compose, initialize_config_dir

    from claas_verl.mopd.recipe_schedule import plan_from_config
    from claas_verl.mopd.trainer.plan_steps import learned_domains
    from claas_verl.paths import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        mopd_keys = [o for o in overrides if o.lstrip("+").startswith("mopd.")]
        cfg = compose(config_name=config_name(recipe), overrides=[*method_overrides(recipe), *mopd_keys])
    m = cfg.mopd
    if float(m.train.top_p) != 1.0:
        raise ValueError(f"{recipe}: mopd.train.top_p={m.train.top_p}; the snapshot scorer samples the full "
                         "distribution (top_p 1.0), as the benchmark recipes train")
    steps = [s.to_dict() for s in plan_from_config(cfg).steps]
    last = {s["stage"]: i for i, s in enumerate(steps)}
    return {"stage_domains": {st: learned_domains(steps, i) for st, i in sorted(last.items())},
            "order": list(m.order), "staged": not any(s["kind"] == "joint" for s in steps),
            "eval": {"prompts": int(m.eval.prompts), "samples": int(m.eval.responses_per_prompt),
                     "max_new_tokens": int(m.train.max_response_length), "temperature": float(m.train.temperature)}}


def _score(model_dir: str, domain: str, expert: str | None, seed: int, protocol: dict, tag: str, models: dict):
    """One model on one domain's held-out prompts (``claas_verl.mopd.eval.gym_snapshots``); ``models`` caches loads."""
    import pandas as pd

    from claas_verl.mopd.eval.gym_snapshots import load_model, score_snapshot
    from claas_verl.tiny.gym import default_gym_dir

    test = default_gym_dir() / "data" / domain / "test.parquet"
    rows = pd.read_parquet(test).to_dict("records")[: protocol["prompts"]]
    for path in (model_dir, expert):
        if path is not None and path not in models:
            models[path] = load_model(path)
    return score_snapshot(model_dir, rows, expert_path=expert, n=protocol["samples"],
                          max_new_tokens=protocol["max_new_tokens"], temperature=protocol["temperature"],
                          seed=seed, tag=tag, model=models[model_dir], expert=models.get(expert))


def score_stage_snapshots(run_dir: Path, stage_domains: dict[int, list[str]], seed: int, protocol: dict):
    """Accuracy and full-vocabulary KL to each domain's expert of every stage-final snapshot
    (``run_dir/snapshots/student_<stage>``), on the domains learned by that stage's end."""
    from claas_verl.tiny.gym import default_gym_dir

    experts = default_gym_dir() / "experts"
    scores: dict[int, dict[str, float]] = {}
    kl: dict[int, dict[str, float]] = {}
    models: dict = {}
    for stage, domains in sorted(stage_domains.items()):
        snap = run_dir / "snapshots" / f"student_{stage}"
        if not (snap / "config.json").exists():
            raise FileNotFoundError(f"{snap}: the stage-{stage} snapshot is missing; the benchmark scores every "
                                    "stage-final snapshot (rerun the method: delete its run directory)")
        for d in domains:
            s = _score(str(snap), d, str(experts / d), seed, protocol, f"student_{stage}/{d}", models)
            scores.setdefault(stage, {})[d] = s.score
            kl.setdefault(stage, {})[d] = s.kl
        models.pop(str(snap), None)
    return scores, kl


def reference_scores(out: Path, seed: int, protocol: dict, bundle: str) -> dict[str, dict[str, float]]:
    """π0's and every expert's accuracy on every domain, scored like the snapshots (same seed, same protocol);
    cached in ``out/reference_scores.json`` (``{"bundle_fingerprint", "scores": {"<seed>:<protocol>": table}}``,
    dropped whole when the bundle changed). Norm's denominators and the "no update" baseline."""
    from claas_verl.tiny.gym import DOMAIN_NAMES, default_gym_dir

    path = out / "reference_scores.json"
    cache = _reference_cache(path, bundle)
    key = f"{seed}:{json.dumps(protocol, sort_keys=True)}"
    if key not in cache:
        root = default_gym_dir()
        models: dict = {}
        table: dict[str, dict[str, float]] = {}
        for name, model_dir in [("student", root / "student")] + [
                (f"expert:{e}", root / "experts" / e) for e in DOMAIN_NAMES]:
            table[name] = {d: _score(str(model_dir), d, None, seed, protocol, f"{name}/{d}", models).score
                           for d in DOMAIN_NAMES}
        cache[key] = table
        path.write_text(json.dumps({"bundle_fingerprint": bundle, "scores": cache}, indent=2) + "\n")
    return cache[key]


def _reference_cache(path: Path, bundle: str) -> dict:
    """The saved reference tables of ``bundle`` (``{"<seed>:<protocol>": table}``); empty when there are none, they
    are of another bundle or the file is damaged (a cache: its tables are scored again)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict) or saved.get("bundle_fingerprint") != bundle:
        return {}
    return saved.get("scores", {})


def _load(out: Path) -> dict:
    """``out/results.json`` (``{"runs": []}`` when there is none); ``ValueError`` naming the file when it is not a
    results file, which is then left as it is (it holds runs that took hours)."""
    path = out / "results.json"
    if not path.exists():
        return {"runs": []}
    try:
        results = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); it was not written by this benchmark as it is (the "
                         "benchmark replaces it atomically): repair it, or move it away to start afresh") from None
    if not isinstance(results, dict) or not isinstance(results.get("runs"), list):
        raise ValueError(f"{path} has no \"runs\" list: it is not this benchmark's results file; use another --out "
                         "or move it away")
    return results


def _save(out: Path, results: dict) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out / "results.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default=None,
                    help="comma-separated methods (" + ",".join(SPELLINGS) + ") or mopd/<name> and claas/<name> "
                         "recipes (default: every method; --quick: "
                         + ",".join(MOPD_QUICK) + ")")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds for every recipe (default: MOPD 1,2,3, CLaaS 3,4,5; --quick: 1 / 3)")
    ap.add_argument("--out", default="/tmp/claas_verl_continual", help="output directory (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the reduced comparison (< 15 min on 2 cores)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="trainer jobs at once (default 1; each job wants about 2 cores and 3 GB)")
    ap.add_argument("--report-only", action="store_true",
                    help="recompute the saved runs' metrics from their stored scores and rewrite the report and "
                         "plots in --out; nothing is trained or scored")
    ap.add_argument("--keep-step-logs", action="store_true",
                    help="copy every MOPD run's steps.jsonl, gzipped, to OUT/steps/<run>.jsonl.gz (the per-step log "
                         "to commit with the results)")
    ap.add_argument("--claas-stream", choices=("contradictory", "compatible"), default="contradictory",
                    help="the CLaaS rule stream: contradictory (default, the committed results) or compatible "
                         "(rules one reply can pass together; docs/benchmark.md)")
    args, extra = ap.parse_known_args(argv)
    bad = [a for a in extra if "=" not in a or a.startswith("-")]
    if bad:
        ap.error(f"unrecognised arguments {bad}: options are --recipes/--seeds/--out/--quick/--jobs/--report-only/"
                 "--keep-step-logs/--claas-stream, the rest key=value")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give at least 1")
    recipes = args.recipes.split(",") if args.recipes else list(MOPD_QUICK if args.quick else MOPD_FULL + CLAAS_FULL)
    unknown = [r for r in recipes if not r.startswith(("mopd/", "claas/"))]
    if unknown:
        ap.error(f"--recipes {unknown}: every recipe is mopd/<name> or claas/<name> (recipes/ holds them)")
    from claas_verl.paths import recipes_dir

    missing = [r for r in recipes if not (recipes_dir() / f"{config_name(r)}.yaml").is_file()]
    if missing:  # refused before a bundle is built or a job started, not minutes later inside a job
        ap.error(f"--recipes {missing}: no such recipe under {recipes_dir()} (the benchmark's own: "
                 f"{','.join(MOPD_FULL + CLAAS_FULL)})")
    if args.seeds is None:
        seeds = dict(QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    else:
        try:
            given = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            ap.error(f"--seeds {args.seeds!r}: expected comma-separated integers such as 1,2,3")
        if any(s < 0 for s in given):
            ap.error(f"--seeds {args.seeds!r}: seeds are non-negative integers (they seed verl's data loader)")
        seeds = {kind: given for kind in DEFAULT_SEEDS}
    for name, values in (("--recipes", recipes), ("--seeds", seeds["mopd"])):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # two jobs of one run would share its run directory
            ap.error(f"{name}: {', '.join(twice)} given more than once")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out}: a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock, Timeout

    lock = FileLock(str(out / ".benchmark.lock"))
    try:  # two benchmarks on one --out would run the same jobs into the same run directories
        lock.acquire(timeout=0)
    except Timeout:
        ap.error(f"--out {out}: another benchmark is running on this directory (it holds {lock.lock_file}); "
                 "wait for it to end or choose another --out")
    try:
        try:
            results = _load(out)  # read under the lock; refused now, not after the bundles are built
        except ValueError as err:
            ap.error(f"--out: {err}")
        if args.report_only:
            return report_only(results, out)
        return _run(results, args.quick, args.jobs, extra, recipes, seeds, out, args.claas_stream,
                    keep_step_logs=args.keep_step_logs)
    finally:
        lock.release()


def keep_step_log(out: Path, recipe: str, seed: int) -> Path | None:
    """``out/steps/<run>.jsonl.gz``: the run's ``steps.jsonl`` gzipped (no timestamp in the header, so the same log
    gives the same bytes); None when the run directory has no step log."""
    name = run_name(recipe, seed)
    src = out / "runs" / name / "steps.jsonl"
    if not src.is_file():
        return None
    dst = out / "steps" / f"{name}.jsonl.gz"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".gz.tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write(src.read_bytes())
    tmp.replace(dst)
    return dst


def _run(results: dict, quick: bool, jobs: int, extra: list[str], recipes: list[str], seeds: dict[str, list[int]],
         out: Path, stream: str = "contradictory", keep_step_logs: bool = False) -> int:
    """The benchmark on a validated command, with ``out`` locked: runs what ``results`` (``out/results.json``) does
    not hold yet, then the report. ``seeds``: the seeds of each kind of recipe (``mopd``, ``claas``)."""
    # records of another evaluation, stream (design), mode or overrides are not this command's: MOPD ones are
    # scored again from their run directories when the job was the same (mopd_run compares its command), others rerun
    bundles = bundle_fingerprints(recipes)
    results["runs"] = [r for r in results["runs"] if current_record(r, quick, extra, bundles, stream)]
    done = {(r["recipe"], int(r["seed"])) for r in results["runs"]}
    manifest = gym_manifest() if "mopd" in bundles else None
    t0 = time.time()
    todo = []
    for recipe in recipes:
        for seed in seeds[recipe.split("/", 1)[0]]:
            if (recipe, seed) in done:
                print(f"=== {recipe} seed {seed}: already in {out / 'results.json'}", flush=True)
                if keep_step_logs and recipe.startswith("mopd/"):
                    keep_step_log(out, recipe, seed)
            else:
                todo.append((recipe, seed))
    saving = threading.Lock()

    def one(recipe: str, seed: int) -> None:
        print(f"=== {recipe} seed {seed}", flush=True)
        if recipe.startswith("mopd/"):
            record = mopd_run(recipe, seed, out, quick, extra, bundles["mopd"])
            if keep_step_logs:
                kept = keep_step_log(out, recipe, seed)
                if kept is None:
                    raise RuntimeError(f"--keep-step-logs: {recipe} seed {seed} wrote no steps.jsonl")
                record["step_log"] = str(kept.relative_to(out))
        else:
            from continual_claas import claas_run

            record = claas_run(recipe, seed, out, quick, extra, stream)
            record["bundle_fingerprint"] = bundles["claas"]
            record.setdefault("kind", "claas")
        with saving:  # every finished run is on disk at once: a kill loses only the runs in flight
            results["runs"].append(record)
            results["summary"] = summarize(results["runs"])
            _save(out, results)
        print(f"=== {recipe} seed {seed}: final_avg {_fmt(record.get('final_avg'))}, forgetting "
              f"{_fmt(record.get('forgetting'))} in {record.get('seconds', 0):.0f}s", flush=True)

    # SIGTERM / Ctrl-C stop the running trainer jobs (each in a process group of its own) before the exit
    with stopping_jobs_on_signals(), ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, recipe, seed): (recipe, seed) for recipe, seed in todo}
    failed = [(rs, f.exception()) for f, rs in futures.items() if f.exception() is not None]
    for (recipe, seed), err in failed:
        print(f"=== {recipe} seed {seed} FAILED: {err}", file=sys.stderr, flush=True)
    aggregate(results)
    if manifest is not None:
        results["bundle"] = {"fingerprint": bundles["mopd"],
                             **{k: manifest[k] for k in ("domains", "accuracy", "accuracy_protocol", "sizes")}}
        # π0 and the experts as the snapshots were scored, per seed of the runs (reference_scores.json)
        results["references"] = _reference_cache(out / "reference_scores.json", bundles["mopd"])
    _save(out, results)
    report = write_report(results, out)
    print("\n" + report)
    print(f"\nresults: {out / 'results.json'}; report: {out / 'report.md'}; plots: {out}/*.png "
          f"({time.time() - t0:.0f}s)")
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(f'{r} seed {s}' for (r, s), _ in failed)} (logs in "
              f"{out / 'runs'}); run the same command again to retry them", file=sys.stderr)
        return 1
    return 0


def report_only(results: dict, out: Path) -> int:
    """``--report-only``: every saved MOPD run's metrics recomputed from its stored stage scores and the stored
    π0/expert scores of its seed, then the summaries, report and plots rewritten. Nothing is trained or scored."""
    if not results["runs"]:
        print(f"--report-only: {out / 'results.json'} holds no runs", file=sys.stderr)
        return 1
    for r in results["runs"]:
        if r.get("kind") == "claas":
            continue
        refs = stored_references(results, r)
        r.update(stats.run_metrics(r["stage_scores"], r["order"], staged=len(r["stage_scores"]) > 1,
                               base=refs["student"], experts={k: v for k, v in refs.items()
                                                              if k.startswith("expert:")}))
    aggregate(results)
    _save(out, results)
    print("\n" + write_report(results, out))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # continual_claas beside this script
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the jobs are stopped already (stopping_jobs_on_signals); no traceback
        sys.exit(130)
