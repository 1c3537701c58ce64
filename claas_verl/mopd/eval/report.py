"""the MOPD paper's results table from evaluation outputs: per-seed scores -> claas_verl.metrics -> markdown + PNG.

Every metric is computed per evaluation seed and then averaged (docs/math.md §B.9, :func:`mean_over_seeds`); the base
student and the experts enter with their seed-mean scores (MOPD paper evaluates them once). The noise half-width of
the Avg difference between two configurations with three seeds each is computed from the pooled SD across
the evaluation seeds of every checkpoint with two or more (MOPD paper App. C, "Evaluation noise").
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from claas_verl.metrics import mopd as mopd_metrics


def load_runs(root: str | Path) -> dict[str, dict]:
    """``{checkpoint name: scores.json}`` for every ``scores.json`` under ``root`` (name = its folder, relative)."""
    root = Path(root)
    runs = {}
    for p in sorted(root.rglob("scores.json")):
        state = json.loads(p.read_text())
        if not state.get("seeds"):
            continue
        runs[str(p.parent.relative_to(root))] = state
    if not runs:
        raise ValueError(f"{root}: no scores.json with evaluated seeds below it "
                         "(run python -m claas_verl.mopd.eval first)")
    return runs


def per_seed(state: dict) -> list[dict[str, float]]:
    return [state["seeds"][s] for s in sorted(state["seeds"], key=int)]


def seed_mean(state: dict) -> dict[str, float]:
    seeds = per_seed(state)
    keys = set.intersection(*(set(s) for s in seeds))
    return {k: math.fsum(s[k] for s in seeds) / len(seeds) for k in keys}


def _safe(fn, *a, **kw) -> float:
    try:
        return fn(*a, **kw)
    except ValueError:
        return math.nan  # a benchmark the metric needs was not evaluated for this checkpoint


def table_rows(runs: dict[str, dict], k: int, base: str | None = None, experts: dict[str, str] | None = None,
               stages: list[str] | None = None) -> tuple[list[str], list[list]]:
    """(header, rows): per checkpoint its domain averages, Avg, Avg11 and Avg_bal (k = 5), Norm and Norm_dom
    (with ``base`` and ``experts``), and the number of evaluation seeds. ``stages`` (the stage-final snapshots
    M_1..M_K of one run, in order) adds a BWT row block."""
    for name in [base, *(experts or {}).values(), *(stages or [])]:
        if name is not None and name not in runs:
            raise ValueError(f"checkpoint {name!r} has no scores; evaluated: {sorted(runs)}")
    base_s = seed_mean(runs[base]) if base else None
    exp_s = {d: seed_mean(runs[n]) for d, n in (experts or {}).items()}
    doms = mopd_metrics.learned_domains(k)
    header = ["Checkpoint", *[d for d in doms], "Avg"] + (["Avg11", "Avg_bal"] if k == 5 else [])
    with_norm = base_s is not None and all(d in exp_s for d in doms)
    header += ["Norm", "Norm_dom"] if with_norm else []
    header += ["seeds"]
    rows = []
    for name, state in runs.items():
        seeds = per_seed(state)
        row = [name] + [_safe(mopd_metrics.mean_over_seeds, mopd_metrics.domain_avg, seeds, d) for d in doms]
        row.append(_safe(mopd_metrics.mean_over_seeds, mopd_metrics.avg, seeds, k))
        if k == 5:
            row += [_safe(mopd_metrics.mean_over_seeds, mopd_metrics.avg11, seeds),
                    _safe(mopd_metrics.mean_over_seeds, mopd_metrics.avg_bal, seeds)]
        if with_norm:
            row += [_safe(mopd_metrics.mean_over_seeds, mopd_metrics.norm, seeds, base_s, exp_s, k),
                    _safe(mopd_metrics.mean_over_seeds, mopd_metrics.norm_dom, seeds, base_s, exp_s, k)]
        rows.append(row + [len(seeds)])
    return header, rows


def bwt_rows(runs: dict[str, dict], stages: list[str]) -> tuple[list[str], list]:
    """BWT per benchmark of the earlier domains (GEM, seed means) and the GEM aggregate, for one run's stages."""
    stage_scores = {j + 1: seed_mean(runs[n]) for j, n in enumerate(stages)}
    K = len(stages)
    # benchmarks of the earlier domains that were evaluated both when learned and at the end
    earlier = [b for j, d in enumerate(mopd_metrics.learned_domains(K)[:-1], 1)
               for b in mopd_metrics.DOMAIN_BENCHMARKS[d]
               if b in stage_scores[K] and b in stage_scores[j]] if K > 1 else []
    per = mopd_metrics.bwt(stage_scores, benchmarks=earlier) if earlier else {}
    return [*per, "BWT_GEM"], [*per.values(), _safe(mopd_metrics.bwt_gem, stage_scores)]


def noise(runs: dict[str, dict], k: int) -> tuple[float, int, float] | None:
    """(pooled SD of Avg across evaluation seeds, its dof, 95% half-width for a 3-vs-3-seed difference)."""
    groups = []
    for state in runs.values():
        vals = [_safe(mopd_metrics.avg, s, k) for s in per_seed(state)]
        if len(vals) >= 2 and all(math.isfinite(v) for v in vals):
            groups.append(vals)
    if not groups:
        return None
    s, dof = mopd_metrics.pooled_sd(groups)
    return s, dof, mopd_metrics.noise_half_width(s, dof)


def _fmt(v, col: str = "") -> str:
    """Points with 2 decimals, the Norm ratios with 3 (as in the MOPD paper's tables); NaN (not evaluated) as n/a."""
    if isinstance(v, float):
        return "n/a" if not math.isfinite(v) else (f"{v:.3f}" if col.startswith("Norm") else f"{v:.2f}")
    return str(v)


def markdown(runs: dict[str, dict], k: int, base=None, experts=None, stages=None) -> str:
    header, rows = table_rows(runs, k, base, experts, stages)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v, c) for v, c in zip(r, header)) + " |" for r in rows]
    nz = noise(runs, k)
    if nz:
        s, dof, hw = nz
        lines += ["", f"Evaluation noise (Avg): pooled SD {s:.2f} over {dof} degrees of freedom; 95% half-width "
                      f"for the difference of two configurations with three seeds each: {hw:.2f}."]
    if stages:
        bh, bv = bwt_rows(runs, stages)
        lines += ["", f"BWT of the run with stages {', '.join(stages)}:", "",
                  "| " + " | ".join(bh) + " |", "|" + "---|" * len(bh), "| " + " | ".join(_fmt(v) for v in bv) + " |"]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict], k: int, path: str | Path, dpi: int = 100) -> Path:
    """Heatmap checkpoint × benchmark (seed means, points) with the Avg column, as PNG (Agg canvas)."""
    import numpy as np

    from claas_verl.utils.plots import new_figure, save_png

    bench = list(mopd_metrics.learned_benchmarks(k))
    names = list(runs)
    means = [seed_mean(runs[n]) for n in names]
    a = np.array([[m.get(b, np.nan) for b in bench]
                  + [_safe(mopd_metrics.mean_over_seeds, mopd_metrics.avg, per_seed(runs[n]), k)]
                  for n, m in zip(names, means)], dtype=float)
    cols = bench + ["Avg"]
    fig = new_figure(1.0 + 0.75 * len(cols), 1.2 + 0.45 * len(names))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(np.ma.masked_invalid(a), cmap="viridis", vmin=0, vmax=100, aspect="auto")
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            if np.isfinite(a[i, j]):
                ax.text(j, i, f"{a[i, j]:.1f}", ha="center", va="center", fontsize=7,
                        color="black" if a[i, j] > 60 else "white")
    ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_title(f"scores (points, mean over evaluation seeds), K = {k}")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02)
    return save_png(fig, path, dpi)
