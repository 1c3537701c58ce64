"""The statistics of the MOPD replay plan (``benchmarks/plans/mopd_replay.md``), read from committed results.

Every comparison is paired by seed, arm − reference, mean ± 95% t half-width
(:func:`claas_verl.metrics.benchmark.mean_half_width`), per domain order and pooled over the orders, and read by the
plan's rule: interval above 0 → "more", below 0 → "less", containing 0 → "no difference detected at ± hw". Runs
whose smallest stage gain is below the plan's 0.15 ("learns") are named.

    # trainer: each recipe against Seq, per order directory and pooled
    python benchmarks/mopd_replay_verdicts.py trainer benchmarks/results/i56_e1_lr1e-3_o1 \\
        benchmarks/results/i56_e1_lr1e-3_o2
    # stage proxy: one arm's JSON against its reference's, files <arm>_lr<lr>_n<n>_o<order>_s<seed>.json
    python benchmarks/mopd_replay_verdicts.py proxy benchmarks/results/i56_proxy/e2 --arm e2 --reference paper

``proxy`` also prints the plan's E2 figure: the ratio arm / reference of the gradient norm (before clipping) of the
first replay step of each stage ≥ 2, its median over stages and seeds.

    # per-step attribution (the plan's E5 reading): where a stage's rise of the first domain's probe KL happens
    python benchmarks/mopd_replay_verdicts.py attribution benchmarks/results/i56_e1_lr1e-3_o1 --stage 3
    python benchmarks/mopd_replay_verdicts.py attribution benchmarks/results/i56_proxy/e2 --proxy-arms paper,e2 \
        --reference paper

``attribution`` reads the runs' committed step logs (``steps/<run>.jsonl.gz``, ``mopd.probe.enabled=true``): after
every step of stage s the probe KL of domain d to M_{s−1}, which is 0 before the stage's first step (the student
is M_{s−1} then). Its rise over the stage is split into the sum of its step-to-step changes over replay steps and
over new-domain steps, per run, then mean ± 95% half-width over each recipe's seeds. A step's change is what the
probe saw after that step's update; AdamW's momentum carries part of each update into the next steps, so a change
is not attributed to a cause by this split.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from claas_verl.metrics.benchmark import mean_half_width  # noqa: E402  (pure python)

LEARNS = 0.15  # the plan's "learns": every stage ends at least this far above π0 on its own domain
METRICS = ("forgetting", "final_avg")
PROXY_NAME = re.compile(r"(?P<arm>.+)_lr(?P<lr>[^_]+)_n(?P<n>\d+)_o(?P<order>\d+)_s(?P<seed>\d+)\.json$")


def reading(mean: float | None, hw: float | None) -> str:
    """The plan's reading rule for one paired interval."""
    if mean is None or hw is None:
        return "no interval"
    if mean - hw > 0:
        return "more"
    if mean + hw < 0:
        return "less"
    return f"no difference detected at ± {hw:.3f}"


def paired(arm: Mapping[int, float], ref: Mapping[int, float]) -> dict:
    """Seed-by-seed ``arm − ref`` over the seeds both have: ``{"seeds", "mean", "hw", "higher", "reading"}``."""
    seeds = sorted(set(arm) & set(ref))
    diffs = [arm[s] - ref[s] for s in seeds]
    mean, hw = mean_half_width(diffs)
    return {"seeds": seeds, "mean": mean, "hw": hw, "higher": sum(d > 0 for d in diffs), "reading": reading(mean, hw)}


def _line(label: str, p: Mapping) -> str:
    if p["mean"] is None:
        return f"  {label}: no common seeds"
    hw = "" if p["hw"] is None else f" ± {p['hw']:.3f}"
    return (f"  {label}: {p['mean']:+.3f}{hw} (n = {len(p['seeds'])}, higher on {p['higher']}); {p['reading']}")


# ------------------------------------------------------------------------------------------------------- trainer
def trainer_runs(directory: Path) -> list[dict]:
    path = directory / "results.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing: give a benchmark result directory (benchmarks/continual.py --out)")
    return [r for r in json.loads(path.read_text())["runs"] if r.get("kind", "mopd") == "mopd"]


def trainer_verdicts(dirs: Sequence[Path], reference: str) -> dict:
    """``{"reference", "not_learning": [...], "comparisons": {recipe: {metric: {"orders": {dir name: paired},
    "pooled": paired}}}}``: every recipe of the directories against ``reference``; seeds of different directories
    are kept apart in the pooled pairing."""
    by_dir = {d.name: trainer_runs(d) for d in dirs}
    recipes = sorted({r["recipe"] for runs in by_dir.values() for r in runs} - {reference})
    out: dict = {"reference": reference, "not_learning": [], "comparisons": {}}
    for name, runs in by_dir.items():
        out["not_learning"] += [f"{name}: {r['recipe']} seed {r['seed']} (smallest stage gain "
                                f"{r['min_stage_gain']:.3f})" for r in runs if r["min_stage_gain"] < LEARNS]
    for recipe in recipes:
        row = {}
        for metric in METRICS:
            per = {}
            pooled_arm, pooled_ref = {}, {}
            for name, runs in by_dir.items():
                arm = {int(r["seed"]): r[metric] for r in runs if r["recipe"] == recipe}
                ref = {int(r["seed"]): r[metric] for r in runs if r["recipe"] == reference}
                per[name] = paired(arm, ref)
                pooled_arm.update({(name, s): v for s, v in arm.items()})
                pooled_ref.update({(name, s): v for s, v in ref.items()})
            row[metric] = {"orders": per, "pooled": paired(pooled_arm, pooled_ref)}
        out["comparisons"][recipe] = row
    return out


# --------------------------------------------------------------------------------------------------------- proxy
def proxy_runs(directory: Path, arm: str) -> dict[tuple[int, int], dict]:
    """``{(order, seed): run JSON}`` of ``arm``'s files in ``directory``."""
    runs = {}
    for path in sorted(directory.glob(f"{arm}_lr*.json")):
        m = PROXY_NAME.match(path.name)
        if m and m["arm"] == arm:
            runs[(int(m["order"]), int(m["seed"]))] = json.loads(path.read_text())
    return runs


def first_replay_grad_norms(run: Mapping) -> dict[int, float]:
    """``{stage: actor/grad_norm of the stage's first replay step}`` (stages with replay only)."""
    out: dict[int, float] = {}
    for step in run["steps"]:
        if step["kind"] == "replay" and step["stage"] not in out:
            out[step["stage"]] = float(step["metrics"]["actor/grad_norm"])
    return out


def proxy_verdicts(directory: Path, arm: str, reference: str) -> dict:
    a, r = proxy_runs(directory, arm), proxy_runs(directory, reference)
    if not a or not r:
        raise SystemExit(f"error: no {arm if not a else reference}_lr*.json in {directory}")
    out: dict = {"arm": arm, "reference": reference, "not_learning": [], "comparisons": {}}
    for name, runs in ((arm, a), (reference, r)):
        out["not_learning"] += [f"{name} order {o} seed {s} (smallest stage gain {gain:.3f})"
                                for (o, s), run in runs.items()
                                if (gain := run["metrics"]["min_stage_gain"]) < LEARNS]
    orders = sorted({o for o, _ in a} | {o for o, _ in r})

    def values(runs: dict, metric: str, order: int) -> dict[int, float]:
        return {s: run["metrics"][metric] for (o, s), run in runs.items() if o == order}

    for metric in METRICS:
        per = {f"order {o}": paired(values(a, metric, o), values(r, metric, o)) for o in orders}
        pooled = paired({k: run["metrics"][metric] for k, run in a.items()},
                        {k: run["metrics"][metric] for k, run in r.items()})
        out["comparisons"][metric] = {"orders": per, "pooled": pooled}
    ratios = []
    for key in sorted(set(a) & set(r)):
        ga, gr = first_replay_grad_norms(a[key]), first_replay_grad_norms(r[key])
        ratios += [ga[st] / gr[st] for st in sorted(set(ga) & set(gr)) if gr[st] > 0]
    out["first_replay_grad_norm_ratio"] = {"median": statistics.median(ratios) if ratios else None, "n": len(ratios)}
    return out


# --------------------------------------------------------------------------------------------------- attribution
def read_step_log(path: Path) -> list[dict]:
    import gzip

    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def probe_rise_by_kind(steps: Sequence[Mapping], stage: int, domain: str) -> dict[str, float]:
    """``{kind: Σ of the step-to-step changes of mopd/probe_kl/<domain> over the stage's steps of that kind}`` and
    ``"total"`` (the value after the stage's last step; the value before its first step is 0)."""
    key = f"mopd/probe_kl/{domain}"
    rows = [st for st in steps if st["stage"] == stage]
    if not rows or any(key not in st["metrics"] for st in rows):
        raise ValueError(f"stage {stage} has no {key} after every step: was mopd.probe.enabled=true?")
    out: dict[str, float] = {}
    before = 0.0
    for st in rows:
        after = float(st["metrics"][key])
        out[st["kind"]] = out.get(st["kind"], 0.0) + after - before
        before = after
    out["total"] = before
    return out


def attribution(dirs: Sequence[Path], stage: int, domain_index: int = 0) -> dict:
    """Per recipe, over its runs in ``dirs``: the stage's probe-KL rise of the ``domain_index``-th domain of each
    run's order, split by step kind (:func:`probe_rise_by_kind`), as ``{part: [mean, hw]}`` and per run."""
    per_recipe: dict[str, list[dict]] = {}
    for d in dirs:
        for run in trainer_runs(d):
            if not run.get("step_log"):
                raise SystemExit(f"error: {d.name}: {run['recipe']} seed {run['seed']} has no step log (run the "
                                 "benchmark with --keep-step-logs)")
            domain = run["order"][domain_index]
            rise = probe_rise_by_kind(read_step_log(d / run["step_log"]), stage, domain)
            per_recipe.setdefault(run["recipe"], []).append({"dir": d.name, "seed": run["seed"], "domain": domain,
                                                             **rise})
    return {"stage": stage, "domain_index": domain_index,
            "recipes": {recipe: _rise_summary(rows) for recipe, rows in per_recipe.items()}}


def _rise_summary(rows: list[dict]) -> dict:
    """``{"runs": rows, part: [mean, hw] for each step kind and "total"}`` (a run without a kind counts 0 there)."""
    parts = sorted({k for r in rows for k in r} - {"dir", "seed", "domain"})
    return {"runs": rows, **{p: mean_half_width([r.get(p, 0.0) for r in rows]) for p in parts}}


def proxy_attribution(directory: Path, arms: Sequence[str], stage: int, domain_index: int = 0) -> dict:
    """:func:`attribution` for stage-proxy JSON files (``<arm>_lr…_o<order>_s<seed>.json``, which carry the same
    per-step records); each arm is a "recipe", each (order, seed) a run."""
    per_arm: dict[str, dict] = {}
    for arm in arms:
        runs = proxy_runs(directory, arm)
        if not runs:
            raise SystemExit(f"error: no {arm}_lr*.json in {directory}")
        rows = []
        for (order, seed), run in sorted(runs.items()):
            domain = run["order"][domain_index]
            rows.append({"dir": f"order {order}", "seed": seed, "domain": domain,
                         **probe_rise_by_kind(run["steps"], stage, domain)})
        per_arm[arm] = _rise_summary(rows)
    return {"stage": stage, "domain_index": domain_index, "recipes": per_arm}


def attribution_paired(result: Mapping, reference: str) -> dict:
    """``{recipe: {part: paired}}``: each recipe's new-domain part and total minus ``reference``'s, run by run
    (a run is its directory and seed)."""
    rows = result["recipes"]
    if reference not in rows:
        raise SystemExit(f"error: no {reference} runs to pair with (recipes: {sorted(rows)})")
    by_run = lambda recipe, part: {(r["dir"], r["seed"]): r.get(part, 0.0) for r in rows[recipe]["runs"]}  # noqa: E731
    return {recipe: {part: paired(by_run(recipe, part), by_run(reference, part)) for part in ("new", "total")}
            for recipe in rows if recipe != reference}


def _print_attribution(result: Mapping) -> None:
    print(f"stage {result['stage']}: rise of the probe KL of each run's domain #{result['domain_index'] + 1} to the "
          "stage's starting model, split by step kind (mean ± 95% half-width over runs)")
    for recipe, row in result["recipes"].items():
        parts = [p for p in row if p != "runs"]
        print(f"  {recipe} ({len(row['runs'])} runs): " + ", ".join(
            f"{p} {row[p][0]:+.3f}" + ("" if row[p][1] is None else f" ± {row[p][1]:.3f}") for p in parts))


def _print(result: Mapping, title: str) -> None:
    print(title)
    for name, rows in result["comparisons"].items():
        for metric, row in rows.items():
            print(f"{name}, {metric}")
            for label, p in row["orders"].items():
                print(_line(label, p))
            print(_line("pooled", row["pooled"]))
    ratio = result.get("first_replay_grad_norm_ratio")
    if ratio is not None:
        med = "n/a" if ratio["median"] is None else f"{ratio['median']:.3f}"
        print(f"first replay step's gradient norm, {result['arm']} / {result['reference']}: median {med} "
              f"over {ratio['n']} (stage, seed) pairs")
    print("runs that do not learn: " + ("; ".join(result["not_learning"]) or "none"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("trainer", help="benchmark result directories (one per domain order)")
    t.add_argument("dirs", nargs="+", type=Path)
    t.add_argument("--reference", default="mopd/gym_seq")
    p = sub.add_parser("proxy", help="a directory of stage-proxy JSON files")
    p.add_argument("dir", type=Path)
    p.add_argument("--arm", required=True)
    p.add_argument("--reference", required=True)
    at = sub.add_parser("attribution", help="a stage's probe-KL rise split by step kind, from the step logs")
    at.add_argument("dirs", nargs="+", type=Path)
    at.add_argument("--proxy-arms", default=None, metavar="A,B,...",
                    help="read stage-proxy JSON files of these arms in the one directory given, not trainer results")
    at.add_argument("--stage", type=int, default=3)
    at.add_argument("--domain-index", type=int, default=0, help="0: each run's first domain (default)")
    at.add_argument("--reference", default="mopd/gym_seq",
                    help="also pair each recipe's new-domain part and total with this recipe's, run by run")
    ap.add_argument("--json", type=Path, default=None, help="also write the verdicts as JSON here")
    args = ap.parse_args(argv)
    if args.kind == "attribution":
        if args.proxy_arms:
            if len(args.dirs) != 1:
                raise SystemExit("error: --proxy-arms reads one directory of stage-proxy JSON files")
            result = proxy_attribution(args.dirs[0], args.proxy_arms.split(","), args.stage, args.domain_index)
        else:
            result = attribution(args.dirs, args.stage, args.domain_index)
        _print_attribution(result)
        if args.reference in result["recipes"]:
            result["paired"] = attribution_paired(result, args.reference)
            for recipe, parts in result["paired"].items():
                for part, p in parts.items():
                    print(_line(f"{recipe} − {args.reference}, {part}", p))
    elif args.kind == "trainer":
        result = trainer_verdicts(args.dirs, args.reference)
        _print(result, f"paired with {args.reference}, per directory and pooled")
    else:
        result = proxy_verdicts(args.dir, args.arm, args.reference)
        _print({**result, "comparisons": {f"{args.arm} − {args.reference}": result["comparisons"]}},
               f"stage proxy, {args.arm} − {args.reference}, per order and pooled")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
