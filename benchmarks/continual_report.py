"""The continual benchmark's report: seed summaries, paired differences, ``report.md`` and the plots.

Pure bookkeeping over ``results.json`` (``benchmarks/continual.py`` runs and scores; ``--report-only`` calls
:func:`aggregate` and :func:`write_report` alone). The CLaaS half of the report is ``benchmarks/continual_claas.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.continual_methods import LABELS, QUICK_MOPD_OVERRIDES  # noqa: E402
from claas_verl.metrics import benchmark as stats  # noqa: E402  (pure python)

PAIRED_BASELINE = "mopd/gym_seq"  # every MOPD method is also compared with it seed by seed (results.json "paired")


def aggregate(results: dict) -> None:
    """The seed summaries and the paired differences of ``results["runs"]``, into ``results``."""
    results["summary"] = summarize(results["runs"])
    mopd = [r for r in results["runs"] if r.get("kind") != "claas"]
    if any(r["recipe"] == PAIRED_BASELINE for r in mopd):
        results["paired"] = {"baseline": PAIRED_BASELINE,
                             "differences": stats.paired_differences(mopd, PAIRED_BASELINE)}
    claas = [r for r in results["runs"] if r.get("kind") == "claas"]
    if claas:
        from continual_claas import BASELINE, claas_paired

        if any(r["recipe"] == BASELINE for r in claas):
            results["claas_paired"] = {"baseline": BASELINE, "differences": claas_paired(claas)}


def stored_references(results: dict, run: dict) -> dict:
    """π0's and the experts' scores saved for ``run``'s seed under its evaluation protocol."""
    for key, table in (results.get("references") or {}).items():
        seed, proto = key.split(":", 1)
        if int(seed) == int(run["seed"]) and json.loads(proto) == run.get("eval"):
            return table
    raise ValueError(f"no stored π0/expert scores for {run['recipe']} seed {run['seed']} under {run.get('eval')}: "
                     "rerun the benchmark without --report-only to score them")


def summarize(runs: list[dict]) -> dict:
    summary = stats.summarize([r for r in runs if r.get("kind") != "claas"])
    claas = [r for r in runs if r.get("kind") == "claas"]
    if claas:
        from continual_claas import claas_summary

        summary.update(claas_summary(claas))
    return summary


def _fmt(v, hw=None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f}" if hw is None else f"{v:.3f} ± {hw:.3f}"


def _cell(pair) -> str:
    m, hw = pair
    return "n/a" if m is None else (f"{m:.3f}" if hw is None else f"{m:.3f} ± {hw:.3f}")


def write_report(results: dict, out: Path) -> str:
    """report.md (returned) and the PNG plots of the MOPD runs (the CLaaS part from continual_claas)."""
    mopd = [r for r in results["runs"] if r.get("kind") != "claas"]
    lines = ["# Continual benchmark", ""]
    if mopd:
        lines += mopd_report(mopd, results)
        from claas_verl.utils.plots import plot_final_bars, plot_stage_accuracy

        by = _by_recipe(mopd)
        order = _order(mopd)
        curves = {LABELS.get(k, k): stats.mean_stage_scores(v) for k, v in by.items()}
        plot_stage_accuracy(curves, order, out / "mopd_stage_accuracy.png")
        summ = results["summary"]
        plot_final_bars({LABELS.get(k, k): summ[k] for k in by}, ("min_stage_gain", "final_avg", "forgetting"),
                        out / "mopd_final_forgetting.png")
        lines += ["", "Plots: `mopd_stage_accuracy.png` (per-domain accuracy after every stage, mean ± 95% "
                  "interval), `mopd_final_forgetting.png` (the smallest stage gain, final accuracy and forgetting)."]
    claas = [r for r in results["runs"] if r.get("kind") == "claas"]
    if claas:
        from continual_claas import claas_plots, claas_report

        lines += ["", claas_report(claas, results["summary"])]
        paths = claas_plots(claas, out)
        lines += ["", "CLaaS plots: " + ", ".join(f"`{p.name}`" for p in paths)]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def _order(runs: list[dict]) -> list[str]:
    """Domains in stage order (the first run's order, then any domain only other runs have)."""
    order: list[str] = []
    for r in runs:
        for d in r.get("order") or [d for row in r["stage_scores"].values() for d in row]:
            if d not in order:
                order.append(d)
    return order


def _by_recipe(runs: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["recipe"], []).append(r)
    return by


def mopd_report(runs: list[dict], results: dict) -> list[str]:
    summ = results["summary"]
    order = _order(runs)
    words = {1: "one", 2: "two", 3: "three"}
    lines = [f"## MOPD: {words.get(len(order), len(order))} reasoning-gym domains, {' → '.join(order)}", ""]
    proto = runs[0].get("eval", {})
    lines += [f"Every stage-final snapshot, π0 and the experts are scored by one evaluator "
              f"(`claas_verl/mopd/eval/gym_snapshots.py`): {proto.get('prompts', '?')} held-out prompts × "
              f"{proto.get('samples', '?')} samples at τ = {proto.get('temperature', '?')}, replies ≤ "
              f"{proto.get('max_new_tokens', '?')} tokens, reasoning-gym's scorers; the KL is the exact "
              "full-vocabulary KL(student || expert), token-mean over the student's own replies.", ""]
    lines += _overrides_note(runs)
    seeds = [str(seed) for seed in sorted({int(r["seed"]) for r in runs})]  # 4, ..., 9, 10: not "10" before "4"
    refs = [t for key, t in (results.get("references") or {}).items() if key.split(":", 1)[0] in seeds]
    if refs:
        lines += [f"References (task accuracy, mean over seeds {', '.join(seeds)}):", "",
                  "| model | " + " | ".join(order) + " |", "|---|" + "---|" * len(order)]
        for name in refs[0]:
            if name.startswith("expert:") and name.split(":", 1)[1] not in order:
                continue  # an expert of a domain these runs did not learn (--quick may leave one out)
            lines.append(f"| {name} | " + " | ".join(
                f"{sum(t[name][d] for t in refs) / len(refs):.3f}" for d in order) + " |")
        lines.append("")
    lines += learning_table(runs, results, order, refs)
    lines += ["| method | seeds | final avg | forgetting | BWT | Norm |", "|---|---|---|---|---|---|"]
    for recipe in _by_recipe(runs):
        s = summ[recipe]
        lines.append(f"| {LABELS.get(recipe, recipe)} (`{recipe}`) | {len(s['seeds'])} | {_cell(s['final_avg'])} | "
                     f"{_cell(s['forgetting'])} | {_cell(s['bwt'])} | {_cell(s['norm'])} |")
    paired = (results.get("paired") or {}).get("differences") or {}
    if paired:
        base = LABELS.get(results["paired"]["baseline"], results["paired"]["baseline"])
        lines += ["", f"Paired with {base}, seed by seed (method − {base}; mean ± 95% interval of the per-seed "
                  "differences):", "", "| method | seeds | Δ final avg | Δ forgetting |", "|---|---|---|---|"]
        for recipe, row in paired.items():
            lines.append(f"| {LABELS.get(recipe, recipe)} | {len(row['seeds'])} | {_cell(row['final_avg'])} | "
                         f"{_cell(row['forgetting'])} |")
    lines += ["", "Per-domain accuracy after each stage (mean ± 95% interval over seeds; the last row of a "
              "recovery run is after recovery):", ""]
    for recipe, rs in _by_recipe(runs).items():
        cells = stats.mean_stage_scores(rs)
        kl = _mean_kl(rs)
        lines += [f"**{LABELS.get(recipe, recipe)}**", "", "| after stage | " + " | ".join(
            f"{d} acc (full-vocabulary KL to E_{d})" for d in order) + " |", "|---|" + "---|" * len(order)]
        for st, row in cells.items():
            lines.append(f"| {st} | " + " | ".join(
                "" if d not in row else f"{_cell(row[d])} ({kl[st][d]:.3f})" for d in order) + " |")
        lines.append("")
    return lines


def _overrides_note(runs: list[dict]) -> list[str]:
    """The command-line overrides the runs were made with, beyond the recipe and the mode's own: the method labels
    name recipes, so a run with ``mopd.train.replay_std_floor=0.3`` would otherwise read as the recipe as written."""
    by: dict[tuple[str, ...], list[dict]] = {}
    for r in runs:
        mode = QUICK_MOPD_OVERRIDES if r.get("quick") else []
        extra = tuple(o for o in r.get("overrides", []) if o not in mode)
        if extra:
            by.setdefault(extra, []).append(r)
    lines = []
    for extra, rs in by.items():
        parts = []
        for recipe, mine in _by_recipe(rs).items():
            if len(mine) == sum(o["recipe"] == recipe for o in runs):
                parts.append(f"`{recipe}`")
            else:  # only some seeds of this recipe
                seeds = sorted(int(o["seed"]) for o in mine)
                parts.append(f"`{recipe}` seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}")
        who = "every run" if len(rs) == len(runs) else "; ".join(parts)
        lines.append(f"Run with the command-line overrides {', '.join(f'`{o}`' for o in extra)} ({who}).")
    return [" ".join(lines), ""] if lines else []


def learning_table(runs: list[dict], results: dict, order: list[str], refs: list[dict]) -> list[str]:
    """Each domain's gain in its own stage (after the stage − π0) beside the forgetting, π0 and the best expert as
    reference rows: a method that forgets nothing because it learned nothing shows it here."""
    gains = stats.gain_summary(runs)
    if not gains:
        return []
    summ = results["summary"]
    lines = ["What each stage taught and what later stages took away (gain = the domain's accuracy right after the "
             "stage that trains it − π0's; mean ± 95% interval over seeds):", "",
             "| method | " + " | ".join(f"gain on {d}" for d in order) + " | smallest gain | forgetting |",
             "|---|" + "---|" * (len(order) + 2)]
    for recipe, row in gains.items():
        lines.append(f"| {LABELS.get(recipe, recipe)} | " + " | ".join(_cell(row.get(d, (None, None))) for d in order)
                     + f" | {_cell(summ[recipe]['min_stage_gain'])} | {_cell(summ[recipe]['forgetting'])} |")
    for name in ("student", None):
        if not refs:
            break
        if name == "student":
            label, vals = "π0 (accuracy)", [sum(t["student"][d] for t in refs) / len(refs) for d in order]
        else:
            experts = [k for k in refs[0] if k.startswith("expert:")]
            label = "best expert (accuracy)"
            vals = [max(sum(t[e][d] for t in refs) / len(refs) for e in experts) for d in order]
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals) + " | | |")
    return lines + [""]


def _mean_kl(runs: list[dict]) -> dict[int, dict[str, float]]:
    acc: dict[int, dict[str, list[float]]] = {}
    for r in runs:
        for st, row in r.get("kl_to_expert", {}).items():
            for d, v in row.items():
                acc.setdefault(int(st), {}).setdefault(d, []).append(float(v))
    return {st: {d: sum(v) / len(v) for d, v in row.items()} for st, row in acc.items()}
