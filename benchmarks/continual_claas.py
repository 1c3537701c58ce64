"""The CLaaS half of the continual benchmark (``benchmarks/continual.py --recipes claas/<a>,...``).

Every method is a CLaaS recipe run through its real trainer, ``python -m claas_verl.main_claas``, over one stream
of K = 5 splits of the rule-following environment (CLaaS paper §4: the split protocol of docs/math.md §A.1.6; every
checkpoint j is
evaluated on every split k, giving M[j, k]). The methods of the CLaaS paper: ``claas/tiny_reinforce_pp``,
``claas/tiny_ppo``, ``claas/tiny_sdpo``, ``claas/tiny_icl`` and the no-update baseline ``claas/tiny_no_update``
(same producers and evaluation, the policy never changes). These are the methods' names
(``benchmarks/continual_methods.py``): each runs its recipe at ``scale=tiny``, e.g. ``claas/reinforce_pp scale=tiny``.

The stream (:data:`DESIGN`), chosen so that the tiny random model can learn and forget. Each scenario has one rule:
``capital_start`` (the reply starts with a capital letter) or ``lowercase`` (no capital letter anywhere), two
rules no reply satisfies together. The tiny model's 12-token samples pass them about 38% and 25% of the time by
chance, so a reward signal exists from the first update, and a REINFORCE++ LoRA policy learns either one alone
within about a dozen updates (a stream of one rule only, one seed each: 0.92 and 0.93 after 15 updates). Splits 1-2 are
``capital_start``, splits 3-5 ``lowercase`` (``claas.stream.split_groups``): a policy that learns the first rule
as a habit instead of reading the system prompt loses it while it learns the second, the forgetting that M's
columns 1-2 show. Designed on seeds 1-2 (the reported run uses seeds 3-5). Rejected designs, measured: the CLaaS paper's
mixed
stream of six rule families (the tiny model's pass or fail was fixed by the rule family, and no method moved M
beyond the no-update baseline's noise); both rules mixed in every split (no learning: a 15-update LoRA does not
learn to read the system prompt; final 0.38 vs 0.36 without updates); ``lowercase`` first (it is learned so
thoroughly that ``capital_start`` is never sampled again, so the later splits give no reward signal: no forgetting,
only a collapse of the later rule). The other stream of :data:`STREAMS`, ``compatible`` (``benchmarks/continual.py
--claas-stream compatible``), follows ``capital_start`` by ``end_punctuation``, which a reply can pass with it
(docs/benchmark.md "A stream of compatible rules").

What the seed changes (each a key of the run): the stream shuffle (``claas.stream.seed``: which scenarios form
which split, the CLaaS paper's "data shuffles"), the replay sampling (``claas.seed``) and the rollout sampling
(``actor_rollout_ref.rollout.seed``: training rollouts and the τ = 1 evaluation samples). The scenario pool
(``claas.env.kwargs.seed``) stays fixed, as in the CLaaS paper: the same 5·S scenarios, split differently per seed.

Sizes (:data:`QUICK` / :data:`FULL`): split size S, turns per scenario and tokens per reply; the rest is the tiny
recipes' (M = 4, B_min = 4, A_max per recipe). Each cell of M grades S scenarios × turns × :data:`EVAL_SAMPLES`
replies (full mode: 4 × 2 × 4 = 32). Per run this module reads the trainer's own records:
``continual_metrics.json`` (M, forward transfer, forgetting, final: :mod:`claas_verl.metrics.continual`) and
``claas_trace.jsonl`` (one line per update, with the rewards of the M entries it drew: the reward curve of
CLaaS paper Fig. 6). Over seeds, :func:`claas_summary` reports ``[mean, half_width]`` (95% t-interval of the mean,
:func:`claas_verl.metrics.benchmark.mean_half_width`; ``None`` with one seed).

Reading the numbers: M's cells are pass rates over a few graded steps each, sampled at τ = 1, so a cell moves by
sampling noise alone; the no-update baseline measures that floor (its rows differ only by noise, and its
"forgetting", a mean of maxima minus the last row, is positive from noise alone).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_jobs import job_env, run_job, tagged  # noqa: E402
from benchmarks.continual_methods import config_name, method_overrides  # noqa: E402
from benchmarks.host import host_signature  # noqa: E402
from claas_verl.metrics.benchmark import mean_half_width, paired_differences, summarize  # noqa: E402  (pure python)

K = 5
# Version of the stream design below: records of an older design are dropped from results.json and rerun.
DESIGN = 2
RULE_FAMILIES = ("lowercase", "capital_start")
SPLIT_GROUPS = ("capital_start", "capital_start", "lowercase", "lowercase", "lowercase")
# The streams ``--claas-stream`` chooses from: (rule families of the pool, the rule of each split). "contradictory"
# is the default above; "compatible" (docs/benchmark.md "A stream of compatible rules") replaces ``lowercase`` by
# ``end_punctuation`` (the reply ends with '.', '!' or '?'), which a reply can pass together with ``capital_start``,
# so forgetting the first rule is possible but not forced.
STREAMS = {
    "contradictory": (RULE_FAMILIES, SPLIT_GROUPS),
    "compatible": (("capital_start", "end_punctuation"),
                   ("capital_start", "capital_start", "end_punctuation", "end_punctuation", "end_punctuation")),
}
DEFAULT_STREAM = "contradictory"
POOL_SIZE = 60      # the scenario pool (fixed: claas.env.kwargs.seed=0); each group has more than the splits need
EVAL_SAMPLES = 4    # replies per graded step in M's evaluation
METRIC_KEYS = ("final_avg", "forgetting", "forward_transfer")
METHODS = ("claas/tiny_reinforce_pp", "claas/tiny_ppo", "claas/tiny_sdpo", "claas/tiny_icl", "claas/tiny_no_update")
BASELINE = "claas/tiny_no_update"  # every method is also compared with it seed by seed (claas_paired)
LABELS = {"claas/tiny_reinforce_pp": "REINFORCE++", "claas/tiny_ppo": "PPO", "claas/tiny_sdpo": "SDPO",
          "claas/tiny_icl": "ICL", "claas/tiny_no_update": "no update"}

# Stream sizes per mode: split_size scenarios per split, turns per scenario, tokens per reply (training and
# evaluation).
QUICK = {"split_size": 2, "num_turns": 2, "max_new_tokens": 12}
FULL = {"split_size": 4, "num_turns": 2, "max_new_tokens": 12}


def label(recipe: str) -> str:
    return LABELS.get(recipe, recipe)


def run_name(recipe: str, seed: int) -> str:
    return f"{recipe.replace('/', '_')}_s{seed}"


def run_overrides(recipe: str, seed: int, quick: bool, stream: str = DEFAULT_STREAM) -> list[str]:
    """The Hydra overrides of one run of ``config_name(recipe)`` (before the user's ``extra``, which win): the
    method's own (``scale=tiny``: :mod:`benchmarks.continual_methods`), the K = 5 grouped stream of
    :data:`STREAMS` ``[stream]`` (default: :data:`SPLIT_GROUPS` over one-rule scenarios of :data:`RULE_FAMILIES`),
    its sizes and the seed keys."""
    families, groups = stream_rules(stream)
    size = QUICK if quick else FULL
    s = int(size["split_size"])
    return [
        *method_overrides(recipe),
        f"trainer.experiment_name={run_name(recipe, seed)}",
        f"claas.stream.num_splits={K}",
        f"claas.stream.split_size={s}",
        f"claas.stream.split_groups=[{','.join(groups)}]",
        f"claas.stream.seed={seed}",
        f"claas.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "claas.env.kwargs.seed=0",
        f"claas.env.kwargs.num_scenarios={POOL_SIZE}",
        f"++claas.env.kwargs.families=[{','.join(families)}]",
        "++claas.env.kwargs.min_rules=1",
        "claas.env.kwargs.max_rules=1",
        f"claas.env.kwargs.num_turns={size['num_turns']}",
        f"claas.eval.n_samples={EVAL_SAMPLES}",
        f"claas.producer.max_new_tokens={size['max_new_tokens']}",
        f"claas.eval.max_new_tokens={size['max_new_tokens']}",
    ]


def stream_rules(stream: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(rule families, rule of each split)`` of the stream named ``stream`` (a key of :data:`STREAMS`)."""
    if stream not in STREAMS:
        raise ValueError(f"unknown CLaaS stream {stream!r}; choose from {sorted(STREAMS)}")
    return STREAMS[stream]


def run_groups(runs: Sequence[Mapping]) -> tuple[str, ...]:
    """The rule of each split of ``runs``' stream (a record without ``stream`` is of :data:`DEFAULT_STREAM`);
    runs of different streams have no common M and are refused."""
    names = {str(r.get("stream", DEFAULT_STREAM)) for r in runs} or {DEFAULT_STREAM}
    if len(names) > 1:
        raise ValueError(f"runs of different CLaaS streams {sorted(names)} cannot be summarised together")
    return stream_rules(names.pop())[1]


def _echo(line: str) -> str | None:
    if "[claas] split" in line or ("[claas] " in line and "updates;" in line):
        return line.split("[claas]", 1)[1].strip()
    return None


def read_reward_curve(trace_path: Path) -> list[list[float]]:
    """``[[update, mean reward of the M entries it drew], ...]`` from ``claas_trace.jsonl`` (empty without updates)."""
    curve = []
    if not trace_path.exists():
        return curve
    for line in trace_path.read_text().splitlines():
        if not line.strip():
            continue
        ev = json.loads(line)
        if ev.get("event") != "update":
            continue
        rewards = [float(s["reward"]) for s in ev.get("sampled") or []]
        if rewards:
            curve.append([int(ev["update"]), math.fsum(rewards) / len(rewards)])
    return curve


def record_from_run_dir(recipe: str, seed: int, run_dir: Path, seconds: float) -> dict:
    """The run record built from a finished run's ``continual_metrics.json`` and ``claas_trace.jsonl``."""
    path = run_dir / "continual_metrics.json"
    if not path.exists():
        raise RuntimeError(f"{path} is missing: the CLaaS run did not finish its split protocol")
    rec = json.loads(path.read_text())
    M = rec["M"]
    if len(M) != K or any(len(row) != K for row in M):
        raise RuntimeError(f"{path}: M is {len(M)}x{len(M[0]) if M else 0}, expected {K}x{K}; was "
                           "claas.stream.num_splits overridden?")
    stage_scores = {j + 1: {f"split_{k + 1}": M[j][k] for k in range(K)} for j in range(K)}
    producer = rec.get("producer") or {}
    return {
        "recipe": recipe, "seed": seed, "kind": "claas", "design": DESIGN, "algorithm": rec.get("algorithm"),
        "stage_scores": stage_scores, "M": M,
        "final_avg": rec["final"], "forgetting": rec["forgetting"], "forward_transfer": rec["forward_transfer"],
        "reward_curve": read_reward_curve(run_dir / "claas_trace.jsonl"),
        "updates": int(rec.get("updates", 0)),
        "rollout_mean_reward": producer.get("mean_reward"),
        "warnings": rec.get("warnings", []),
        "run_dir": str(run_dir), "seconds": round(float(seconds), 1), "host": host_signature(),
    }


def claas_run(recipe: str, seed: int, out_dir: Path, quick: bool, extra: list[str],
              stream: str = DEFAULT_STREAM) -> dict:
    """One CLaaS method under one seed: ``python -m claas_verl.main_claas --config-name <recipe>`` over K = 5 splits.

    The run writes into ``out_dir/runs/<recipe with / as _>_s<seed>/`` (emptied first: its trace file is appended
    to) and logs to ``out_dir/runs/<name>.log``. Returns the run record: ``recipe``, ``seed``, ``stage_scores``
    ``{j: {"split_k": M[j, k]}}`` (j = checkpoint after split j, 1-based), ``M``, ``final_avg``, ``forgetting``,
    ``forward_transfer``, ``reward_curve`` ``[[update, mean reward of the drawn entries], ...]``, ``updates``,
    ``rollout_mean_reward`` (all training rollouts), ``run_dir``, ``seconds``.
    """
    out_dir = Path(out_dir)
    name = run_name(recipe, seed)
    runs = out_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = runs / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "claas_verl.main_claas", f"--config-name={config_name(recipe)}",
           *run_overrides(recipe, seed, quick, stream), *extra]
    seconds = run_job(cmd, job_env(CLAAS_OUT_DIR=str(runs)), runs / f"{name}.log", tagged(name, _echo))
    record = record_from_run_dir(recipe, seed, run_dir, seconds)
    record["quick"] = bool(quick)
    record["stream"] = stream
    record["overrides"] = list(extra)
    return record


# ---------------------------------------------------------------------------------------------------- summary
def _by_recipe(runs: Sequence[Mapping]) -> dict[str, list[Mapping]]:
    by: dict[str, list[Mapping]] = {}
    for r in runs:
        by.setdefault(str(r["recipe"]), []).append(r)
    return by


def mean_matrix(runs: Sequence[Mapping]) -> list[list[float | None]]:
    """Cell-wise mean of the runs' M (cells that are None in a run are left out of that cell's mean).

    For display only: the metrics of the mean matrix are not the mean metrics (the max in forgetting does not
    commute with the mean), so the summary averages the per-run metrics.
    """
    n = len(runs[0]["M"])
    out = []
    for j in range(n):
        row = []
        for k in range(n):
            vals = [float(r["M"][j][k]) for r in runs if r["M"][j][k] is not None]
            row.append(math.fsum(vals) / len(vals) if vals else None)
        out.append(row)
    return out


def group_means(M: Sequence[Sequence[float | None]], groups: Sequence[str] = SPLIT_GROUPS
                ) -> dict[str, list[float | None]]:
    """``{group: [mean of M[j, k] over the splits k of that group, for each checkpoint j]}``: how well the policy
    after split j follows each rule (cells that are None are left out)."""
    out: dict[str, list[float | None]] = {}
    for g in dict.fromkeys(groups):
        cols = [k for k, gk in enumerate(groups) if gk == g]
        row = []
        for j in range(len(M)):
            vals = [float(M[j][k]) for k in cols if M[j][k] is not None]
            row.append(math.fsum(vals) / len(vals) if vals else None)
        out[g] = row
    return out


def claas_summary(runs: Sequence[Mapping]) -> dict:
    """``{recipe: {"final_avg": [mean, hw], "forgetting": [...], "forward_transfer": [...], "seeds": [...],
    "M_mean": K x K cell-wise mean, "updates": [mean, hw], "rule_means": {rule: [[mean, hw] after split j, ...]}}}``
    over each recipe's seeds (hw: 95% t half-width; ``rule_means`` from :func:`group_means` of each run's M)."""
    out = summarize(runs, METRIC_KEYS)
    groups = run_groups(runs)
    for recipe, rs in _by_recipe(runs).items():
        out[recipe]["M_mean"] = mean_matrix(rs)
        out[recipe]["updates"] = mean_half_width([r.get("updates") for r in rs])
        per_run = [group_means(r["M"], groups) for r in rs]
        out[recipe]["rule_means"] = {g: [mean_half_width([gm[g][j] for gm in per_run]) for j in range(K)]
                                     for g in dict.fromkeys(groups)}
    return out


def claas_paired(runs: Sequence[Mapping], baseline: str = BASELINE) -> dict:
    """Each method minus ``baseline``, seed by seed (the same seed gives both the same splits, so the pairing
    removes which scenarios landed where): ``{recipe: {"seeds": [...], "final_avg" / "forgetting" /
    "forward_transfer": [mean, hw], "rule_means": {rule: [[mean, hw] after split j, ...]}}}``."""
    out = paired_differences(runs, baseline, METRIC_KEYS)
    groups = run_groups(runs)
    base = {int(r["seed"]): group_means(r["M"], groups) for r in runs if r["recipe"] == baseline}
    for recipe, row in out.items():
        mine = {int(r["seed"]): group_means(r["M"], groups) for r in runs if r["recipe"] == recipe}
        row["rule_means"] = {g: [mean_half_width([_diff(mine[s][g][j], base[s][g][j]) for s in row["seeds"]])
                                 for j in range(K)]
                             for g in dict.fromkeys(groups)}
    return out


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _pm(pair, digits: int = 3) -> str:
    m, hw = pair
    if m is None:
        return "n/a"
    return f"{m:.{digits}f}" if hw is None else f"{m:.{digits}f} ± {hw:.{digits}f}"


def _split_label(k: int, groups: Sequence[str] = SPLIT_GROUPS) -> str:
    return f"{k + 1} ({groups[k]})" if k < len(groups) else str(k + 1)


def claas_report(runs: Sequence[Mapping], summary: Mapping) -> str:
    """Markdown: the per-method table (final, forgetting, FWT with 95% intervals) and each method's mean M."""
    by = _by_recipe(runs)
    n_seeds = sorted({len(rs) for rs in by.values()})
    groups = run_groups(runs)
    contradict = set(groups) == {"capital_start", "lowercase"}
    lines = [
        f"## CLaaS: K = {K} splits of the rule-following stream",
        "",
        "Splits by rule (one rule per scenario, `claas.stream.split_groups`): "
        + ", ".join(f"{k + 1}: `{g}`" for k, g in enumerate(groups))
        + (". The two rules contradict each other (no reply passes both)." if contradict
           else ". A reply can pass every rule at once."),
        "",
        "Mean over seeds ± half-width of the 95% t-interval of the mean (no interval with one seed). "
        "M[j, k] = defender pass rate of the checkpoint after split j on split k; FWT = mean of the cells above "
        "the diagonal, forgetting = mean over k < K of (best M[j, k] for j ≥ k) − M[K, k], final = mean of the "
        "last row (docs/math.md §A.4).",
        "",
        "| method | recipe | seeds | final | forgetting | forward transfer | updates |",
        "|---|---|---|---|---|---|---|",
    ]
    for recipe, rs in by.items():
        s = summary[recipe]
        upd = s.get("updates") or mean_half_width([r.get("updates") for r in rs])
        lines.append(f"| {label(recipe)} | `{recipe}` | {len(rs)} | {_pm(s['final_avg'])} | {_pm(s['forgetting'])} | "
                     f"{_pm(s['forward_transfer'])} | {_pm(upd, 1)} |")
    if n_seeds == [1]:
        lines += ["", "One seed per method: no intervals; differences below about ±0.2 are within the sampling "
                  "noise of one cell (a handful of graded steps per cell)."]
    # each rule's mean pass rate after every checkpoint: learning (its own splits) and forgetting (later splits)
    lines += ["", "### Pass rate per rule after each split (mean of M over that rule's splits; mean over seeds ± "
              "95% half-width)", "", "| method | rule | " + " | ".join(f"after {j + 1}" for j in range(K)) + " |",
              "|---|---" + "|---" * K + "|"]
    for recipe, rs in by.items():
        rule_means = summary[recipe].get("rule_means") or claas_summary(rs)[recipe]["rule_means"]
        for g, row in rule_means.items():
            lines.append(f"| {label(recipe)} | `{g}` | " + " | ".join(_pm(v, 2) for v in row) + " |")
    paired = claas_paired(runs)
    if paired:
        lines += ["", f"### Paired with {label(BASELINE)}, seed by seed (method − baseline; mean ± 95% half-width)",
                  "", "| method | seeds | final | forgetting | FWT | "
                  + " | ".join(f"`{g}` after {j + 1}" for g in dict.fromkeys(groups) for j in range(K)) + " |",
                  "|---|---|---|---|---" + "|---" * (K * len(set(groups))) + "|"]
        for recipe, row in paired.items():
            cells = [_pm(v, 2) for g in dict.fromkeys(groups) for v in row["rule_means"][g]]
            lines.append(f"| {label(recipe)} | {len(row['seeds'])} | {_pm(row['final_avg'])} | "
                         f"{_pm(row['forgetting'])} | {_pm(row['forward_transfer'])} | " + " | ".join(cells) + " |")
    for recipe, rs in by.items():
        M = summary[recipe].get("M_mean") or mean_matrix(rs)
        lines += ["", f"### {label(recipe)}: mean M[j, k] over {len(rs)} seed(s)", "",
                  "| checkpoint \\ split | " + " | ".join(_split_label(k, groups) for k in range(len(M))) + " |",
                  "|---" * (len(M) + 1) + "|"]
        for j, row in enumerate(M):
            lines.append(f"| after split {j + 1} | "
                         + " | ".join("n/a" if v is None else f"{v:.2f}" for v in row) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- plots
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def mean_reward_curve(runs: Sequence[Mapping]) -> list[list[float]]:
    """``[[update, mean over the seeds that reached it], ...]``: the per-update reward averaged over seeds."""
    cells: dict[int, list[float]] = {}
    for r in runs:
        for u, v in r.get("reward_curve") or []:
            cells.setdefault(int(u), []).append(float(v))
    return [[u, math.fsum(vs) / len(vs)] for u, vs in sorted(cells.items())]


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1): i + 1]
        out.append(math.fsum(part) / len(part))
    return out


def claas_plots(runs: Sequence[Mapping], out_dir: Path) -> list[Path]:
    """PNGs in ``out_dir``: mean M heatmap per method, reward over updates per method, final/forgetting/FWT bars."""
    from claas_verl.utils.plots import plot_transfer_heatmap

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by = _by_recipe(runs)
    summary = claas_summary(runs)
    paths: list[Path] = []
    for recipe, rs in by.items():
        M = mean_matrix(rs)
        if any(v is None for row in M for v in row):
            continue  # a cell no run could grade: the heatmap needs every cell
        paths.append(plot_transfer_heatmap(
            M, out_dir / f"claas_M_{recipe.replace('/', '_')}.png",
            title=f"{label(recipe)}: mean M[j, k] ({len(rs)} seed{'s' if len(rs) > 1 else ''})"))

    # reward over updates (CLaaS paper Fig. 6): mean reward of the entries each update drew, mean over seeds
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    colors = {}
    flat = 0  # methods drawn as a horizontal line get distinct dash styles (equal values would hide each other)
    for i, (recipe, rs) in enumerate(by.items()):
        color = f"C{i}"
        colors[recipe] = color
        curve = mean_reward_curve(rs)
        if curve:
            xs = [u for u, _ in curve]
            ys = [v for _, v in curve]
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, _smooth(ys, 5), color=color, linewidth=1.8, label=f"{label(recipe)} (5-update mean)")
        else:
            vals = [r.get("rollout_mean_reward") for r in rs if r.get("rollout_mean_reward") is not None]
            if vals:
                style = ("--", ":", "-.")[flat % 3]
                flat += 1
                ax.axhline(math.fsum(vals) / len(vals), color=color, linestyle=style, linewidth=1.6,
                           label=f"{label(recipe)} (no updates: mean rollout reward)")
    ax.set_xlabel("update")
    ax.set_ylabel("mean reward of the drawn entries")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"CLaaS reward over updates (mean over seeds, K = {K} splits)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = out_dir / "claas_reward_curve.png"
    fig.savefig(path, format="png", dpi=100)
    paths.append(path)

    # final / forgetting / FWT with 95% intervals
    names = list(by)
    fig = _figure(4.0 * len(METRIC_KEYS), 3.8)
    for i, key in enumerate(METRIC_KEYS):
        ax = fig.add_subplot(1, len(METRIC_KEYS), i + 1)
        means = [summary[r][key][0] for r in names]
        hws = [summary[r][key][1] for r in names]
        xs = list(range(len(names)))
        ax.bar(xs, [0.0 if m is None else m for m in means], color=[colors[r] for r in names])
        for x, m, h in zip(xs, means, hws):
            if m is not None and h is not None:  # one seed: no interval, and no zero-width bar pretending one
                ax.errorbar([x], [m], yerr=[h], color="black", capsize=4)
        ax.set_ylim(0.0, 1.0)  # pass rates and their differences: one fixed scale, so methods compare at a glance
        ax.set_xticks(xs, [label(r) for r in names], rotation=30, ha="right", fontsize=8)
        ax.set_title({"final_avg": "final", "forgetting": "forgetting",
                      "forward_transfer": "forward transfer"}[key])
        ax.axhline(0.0, color="black", linewidth=0.6)
    seeds = sorted({len(rs) for rs in by.values()})
    note = ", 95% interval of the mean" if seeds != [1] else " (one seed: no interval)"
    fig.suptitle("CLaaS: mean over seeds" + note, fontsize=10)
    fig.tight_layout()
    path = out_dir / "claas_final_forgetting_fwt.png"
    fig.savefig(path, format="png", dpi=100)
    paths.append(path)
    return paths
