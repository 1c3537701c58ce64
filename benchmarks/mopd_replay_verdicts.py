"""The statistics of the MOPD replay plan (``benchmarks/plans/mopd_replay.md``), read from committed results.

Compared: forgetting and final average, and the plan's secondary metrics wherever every run carries them (the first
domain's accuracy after stages 2 and 3; trainer runs: its top-κ KL to its expert after stage 3). Every comparison
is paired by seed, arm − reference, mean ± 95% t half-width
(:func:`claas_verl.metrics.benchmark.mean_half_width`), per domain order and pooled over the orders, and read by the
plan's rule: interval above 0 → "more", below 0 → "less", containing 0 → "no difference detected at ± hw". Runs
whose smallest stage gain is below the plan's 0.15 ("learns") are named.

    # trainer: each recipe against Seq, per order directory and pooled
    python benchmarks/mopd_replay_verdicts.py trainer benchmarks/results/i56_e1_lr1e-3_o1 \\
        benchmarks/results/i56_e1_lr1e-3_o2
    # stage proxy: one arm's JSON against its reference's, files <arm>_lr<lr>_n<n>_o<order>_s<seed>.json
    python benchmarks/mopd_replay_verdicts.py proxy benchmarks/results/i56_proxy/e2 --arm e2 --reference paper
    # any two series, across directories and kinds of run, or a difference of differences of four
    python benchmarks/mopd_replay_verdicts.py contrast \
        --arm trainer:mopd/gym_replay_kl@benchmarks/results/i56_e2_o1,benchmarks/results/i56_e2_o2 \
        --reference trainer:mopd/gym_replay_kl@benchmarks/results/i56_e1_lr1e-3_o1,benchmarks/results/i56_e1_lr1e-3_o2
    python benchmarks/mopd_replay_verdicts.py contrast --arm proxy:DIR/paper@3e-4 --reference proxy:DIR/seq@3e-4 \
        --base-arm proxy:DIR/paper@1e-3 --base-reference proxy:DIR/seq@1e-3

A series is paired by (domain order, seed): a trainer run with a proxy run never pairs. ``proxy`` and ``contrast``
also print the plan's E2 figure: the ratio arm / reference of the gradient norm (before clipping) of the
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
# the plan's secondary metrics that the run records carry: the first domain's accuracy after stages 2 and 3, and
# (trainer only) its top-κ KL to its expert after stage 3; compared wherever every run of a contrast has them
SECONDARY = ("first_after_2", "first_after_3", "first_kl_to_expert_3")
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


def summarise(diffs: Mapping) -> dict:
    """``{"seeds", "mean", "hw", "higher", "reading"}`` of per-pair differences keyed by seed (or (order, seed))."""
    seeds = sorted(diffs)
    values = [diffs[s] for s in seeds]
    mean, hw = mean_half_width(values)
    return {"seeds": seeds, "mean": mean, "hw": hw, "higher": sum(d > 0 for d in values), "reading": reading(mean, hw)}


def paired(arm: Mapping, ref: Mapping) -> dict:
    """Seed-by-seed ``arm − ref`` over the seeds both have (:func:`summarise`)."""
    return summarise({s: arm[s] - ref[s] for s in set(arm) & set(ref)})


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
    """``{"reference", "not_learning": [...], "comparisons": {recipe: {metric: {"orders": {order: paired},
    "pooled": paired}}}}``: every recipe of the directories against ``reference``, each a :func:`contrast` of two
    trainer series (so pairs are (domain order, seed), as everywhere else); "not_learning" lists every run of the
    directories, paired or not."""
    series = trainer_series_by_recipe(dirs)
    not_learning = [f"order {o}: {recipe} seed {seed} (smallest stage gain {g:.3f})"
                    for recipe, runs in sorted(series.items()) for (o, seed), run in sorted(runs.items())
                    if (g := run["metrics"]["min_stage_gain"]) < LEARNS]
    out: dict = {"reference": reference, "not_learning": not_learning, "comparisons": {},
                 "machines": {"one": 0, "across": 0, "unrecorded": 0}}
    for recipe in sorted(set(series) - {reference}):
        pair = contrast({recipe: series[recipe], reference: series.get(reference, {})}, recipe, reference,
                        grad_norm_ratio=False)
        out["comparisons"][recipe] = pair["comparisons"]
        out["machines"] = {k: n + pair["machines"][k] for k, n in out["machines"].items()}
    return out


# ----------------------------------------------------------------------------------------------- paired series
# A series is one arm's runs, {(domain order, seed): {"kind", "metrics", "steps": list | Path | None, "bundle",
# "host": the machine (benchmarks/host.py) or None where the record predates it},
# from stage-proxy JSON files or from trainer result directories; contrasts pair series key by key.
Series = dict


def _order_label(run: Mapping, fallback: str) -> str:
    return "→".join(run["order"]) if run.get("order") else fallback


def secondary_metrics(run: Mapping) -> dict[str, float]:
    """:data:`SECONDARY` of one run record (proxy JSON or trainer ``results.json`` row), those it can give."""
    order, scores, kl = run.get("order"), run.get("stage_scores") or {}, run.get("kl_to_expert") or {}
    if not order:
        return {}
    first, out = order[0], {}
    for stage in (2, 3):
        if first in scores.get(str(stage), {}):
            out[f"first_after_{stage}"] = float(scores[str(stage)][first])
    if first in kl.get("3", {}):
        out["first_kl_to_expert_3"] = float(kl["3"][first])
    return out


def proxy_runs(directory: Path, arm: str, lr: str | None = None) -> dict[tuple[int, int], dict]:
    """``{(order, seed): run JSON}`` of ``arm``'s files in ``directory`` (at ``lr`` when given). A directory that
    holds the arm at several (lr, steps) settings needs ``lr``: seeds of different settings are never paired."""
    runs, settings = {}, {}
    for path in sorted(directory.glob(f"{arm}_lr*.json")):
        m = PROXY_NAME.match(path.name)
        if m and m["arm"] == arm and (lr is None or m["lr"] == lr):
            settings.setdefault((m["lr"], m["n"]), []).append(path.name)
            runs[(int(m["order"]), int(m["seed"]))] = json.loads(path.read_text())
    if len(settings) > 1:
        found = ", ".join(f"lr {a} with {b} steps" for a, b in sorted(settings))
        raise SystemExit(f"error: {directory} holds {arm} at {found}: name one with --lr (proxy) or {arm}@LR "
                         "(contrast)")
    return runs


def proxy_series(directory: Path, arm: str, lr: str | None = None) -> Series:
    return {(_order_label(run, f"order {o}"), s): {"kind": "proxy",
                                                   "metrics": {**run["metrics"], **secondary_metrics(run)},
                                                   "steps": run.get("steps"), "bundle": None,
                                                   "host": run.get("host")}
            for (o, s), run in proxy_runs(directory, arm, lr).items()}


def trainer_series_by_recipe(dirs: Sequence[Path]) -> dict[str, Series]:
    """``{recipe: series}`` of every run in the result directories, each ``results.json`` read once; a step log is
    read only when a statistic needs it."""
    out: dict[str, Series] = {}
    for d in dirs:
        for run in trainer_runs(d):
            series = out.setdefault(run["recipe"], {})
            key = (_order_label(run, d.name), int(run["seed"]))
            if key in series:
                raise SystemExit(f"error: {run['recipe']} seed {key[1]} in order {key[0]} appears twice in "
                                 f"{', '.join(map(str, dirs))}: give each order's directory once")
            series[key] = {"kind": "trainer",
                           "metrics": {**{m: run[m] for m in (*METRICS, "min_stage_gain")}, **secondary_metrics(run)},
                           "steps": (d / run["step_log"]) if run.get("step_log") else None,
                           "bundle": run.get("bundle_fingerprint"), "host": run.get("host")}
    return out


def parse_series(spec: str) -> tuple[str, Series]:
    """``proxy:DIR/ARM[@LR]`` or ``trainer:RECIPE@DIR[,DIR...]`` → (label, series)."""
    kind, _, rest = spec.partition(":")
    if kind == "proxy" and rest:
        path, _, lr = rest.partition("@")
        series = proxy_series(Path(path).parent, Path(path).name, lr or None)
    elif kind == "trainer" and "@" in rest:
        recipe, _, dirs = rest.partition("@")
        series = trainer_series_by_recipe([Path(d) for d in dirs.split(",")]).get(recipe, {})
    else:
        raise SystemExit(f"error: {spec!r}: a series is proxy:DIR/ARM[@LR] (stage-proxy JSON files ARM_lrLR_…) or "
                         "trainer:RECIPE@DIR[,DIR...] (benchmark result directories, one per domain order)")
    if not series:
        raise SystemExit(f"error: {spec!r} names no runs")
    return spec, series


def _steps(entry: Mapping) -> list[dict] | None:
    steps = entry["steps"]
    return read_step_log(steps) if isinstance(steps, Path) else steps


def first_replay_grad_norms(steps: Sequence[Mapping]) -> dict[int, float]:
    """``{stage: actor/grad_norm of the stage's first replay step}`` (stages with replay only)."""
    out: dict[int, float] = {}
    for step in steps:
        if step["kind"] == "replay" and step["stage"] not in out:
            out[step["stage"]] = float(step["metrics"]["actor/grad_norm"])
    return out


def contrast(series: Mapping[str, Series], arm: str, reference: str, base_arm: str | None = None,
             base_reference: str | None = None, *, grad_norm_ratio: bool = True) -> dict:
    """``arm − reference``, or the difference of differences ``(arm − reference) − (base_arm − base_reference)``,
    pair by pair over the (domain order, seed) keys every named series has; per order and pooled, with the
    "learns" check of every run used and, for a plain contrast whose runs carry step records, E2's ratio of the
    first replay steps' gradient norms (arm / reference, median over stages and pairs; ``grad_norm_ratio=False``
    skips it and the step logs it reads)."""
    names = [n for n in (arm, reference, base_arm, base_reference) if n is not None]
    if (base_arm is None) != (base_reference is None):
        raise SystemExit("error: a difference of differences needs both --base-arm and --base-reference")
    kinds = {entry["kind"] for n in names for entry in series[n].values()}
    if len(kinds) > 1:
        raise SystemExit(f"error: {', '.join(names)} mix stage-proxy and trainer runs, which are never paired")
    keys = sorted(set.intersection(*(set(series[n]) for n in names)))
    if not keys:
        raise SystemExit(f"error: {', '.join(names)} have no (domain order, seed) in common")
    for key in keys:
        bundles = {series[n][key]["bundle"] for n in names} - {None}
        if len(bundles) > 1:
            raise SystemExit(f"error: order {key[0]} seed {key[1]} was run on different bundles {sorted(bundles)}")
    out: dict = {"arm": arm, "reference": reference, "base_arm": base_arm, "base_reference": base_reference,
                 "not_learning": [f"{n}: order {o} seed {s} (smallest stage gain {g:.3f})" for n in names
                                  for (o, s) in keys if (g := series[n][(o, s)]["metrics"]["min_stage_gain"]) < LEARNS],
                 "comparisons": {}}

    def value(name: str, key, metric: str) -> float:
        return float(series[name][key]["metrics"][metric])

    carried = [m for m in SECONDARY if all(m in series[n][k]["metrics"] for n in names for k in keys)]
    for metric in (*METRICS, *carried):
        diffs = {k: value(arm, k, metric) - value(reference, k, metric) for k in keys}
        if base_arm is not None:
            diffs = {k: d - (value(base_arm, k, metric) - value(base_reference, k, metric)) for k, d in diffs.items()}
        per = {o: summarise({s: d for (oo, s), d in diffs.items() if oo == o}) for o in sorted({o for o, _ in keys})}
        out["comparisons"][metric] = {"orders": per, "pooled": summarise(diffs)}
    ratios: list[float] = []
    with_steps = all(series[n][k]["steps"] is not None for n in (arm, reference) for k in keys)
    if grad_norm_ratio and base_arm is None and with_steps:
        for key in keys:
            ga, gr = (first_replay_grad_norms(_steps(series[n][key])) for n in (arm, reference))
            ratios += [ga[st] / gr[st] for st in sorted(set(ga) & set(gr)) if gr[st] > 0]
    out["first_replay_grad_norm_ratio"] = {"median": statistics.median(ratios) if ratios else None, "n": len(ratios)}
    out["machines"] = pair_machines([[series[n][k].get("host") for n in names] for k in keys])
    return out


def pair_machines(pairs: Sequence[Sequence[Mapping | None]]) -> dict[str, int]:
    """How many pairs were made on one recorded machine, across recorded machines, or with a run whose record
    names none (made before records carried ``host``). The arithmetic, and with it a seed's outcome after its first
    stage, differs between machines (benchmarks/host.py), so a pair across machines shares less than one made on
    one machine."""
    out = {"one": 0, "across": 0, "unrecorded": 0}
    for hosts in pairs:
        out["unrecorded" if any(h is None for h in hosts) else
            "one" if all(h == hosts[0] for h in hosts) else "across"] += 1
    return out


def proxy_verdicts(directory: Path, arm: str, reference: str, lr: str | None = None) -> dict:
    a, r = proxy_series(directory, arm, lr), proxy_series(directory, reference, lr)
    if not a or not r:
        raise SystemExit(f"error: no {arm if not a else reference}_lr*.json in {directory}")
    return contrast({arm: a, reference: r}, arm, reference)


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


def proxy_attribution(directory: Path, arms: Sequence[str], stage: int, domain_index: int = 0,
                      lr: str | None = None) -> dict:
    """:func:`attribution` for stage-proxy JSON files (``<arm>_lr…_o<order>_s<seed>.json``, which carry the same
    per-step records); each arm is a "recipe", each (order, seed) a run."""
    per_arm: dict[str, dict] = {}
    for arm in arms:
        runs = proxy_runs(directory, arm, lr)
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
    if ratio is not None and ratio["n"]:
        med = "n/a" if ratio["median"] is None else f"{ratio['median']:.3f}"
        print(f"first replay step's gradient norm, {result['arm']} / {result['reference']}: median {med} "
              f"over {ratio['n']} (stage, seed) pairs")
    print("runs that do not learn: " + ("; ".join(result["not_learning"]) or "none"))
    if (machines := result.get("machines")) is not None:
        print(f"pairs by machine: {machines['one']} made on one machine, {machines['across']} across machines, "
              f"{machines['unrecorded']} with a run whose record names no machine")


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
    p.add_argument("--lr", default=None, help="the files' lr as written in their names (1e-3); needed where the "
                   "directory holds the arms at several")
    c = sub.add_parser("contrast", help="any two series, or a difference of differences of four",
                       description="SERIES is proxy:DIR/ARM[@LR] (stage-proxy JSON files) or "
                       "trainer:RECIPE@DIR[,DIR...] (benchmark result directories, one per domain order). Pairs by "
                       "(domain order, seed).")
    for flag in ("--arm", "--reference"):
        c.add_argument(flag, required=True, metavar="SERIES")
    for flag in ("--base-arm", "--base-reference"):
        c.add_argument(flag, default=None, metavar="SERIES",
                       help="with both: (arm − reference) − (base-arm − base-reference), pair by pair")
    at = sub.add_parser("attribution", help="a stage's probe-KL rise split by step kind, from the step logs")
    at.add_argument("dirs", nargs="+", type=Path)
    at.add_argument("--proxy-arms", default=None, metavar="A,B,...",
                    help="read stage-proxy JSON files of these arms in the one directory given, not trainer results")
    at.add_argument("--lr", default=None, help="with --proxy-arms: the files' lr, where the directory holds several")
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
            result = proxy_attribution(args.dirs[0], args.proxy_arms.split(","), args.stage, args.domain_index,
                                       args.lr)
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
        _print(result, f"paired with {args.reference}, per domain order and pooled")
    elif args.kind == "contrast":
        series = dict(parse_series(spec) for spec in (args.arm, args.reference, args.base_arm, args.base_reference)
                      if spec is not None)
        result = contrast(series, args.arm, args.reference, args.base_arm, args.base_reference)
        title = f"({args.arm}) − ({args.reference})"
        if args.base_arm is not None:
            title = f"[{title}] − [({args.base_arm}) − ({args.base_reference})]"
        _print({**result, "comparisons": {title: result["comparisons"]}}, f"{title}, per order and pooled")
    else:
        result = proxy_verdicts(args.dir, args.arm, args.reference, args.lr)
        _print({**result, "comparisons": {f"{args.arm} − {args.reference}": result["comparisons"]}},
               f"stage proxy, {args.arm} − {args.reference}, per order and pooled")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
