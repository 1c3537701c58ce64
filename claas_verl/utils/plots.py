"""The PNG figures of the continual metrics: the checkpoint × split heatmap of M[j, k] (CLaaS paper Fig. 5;
docs/math.md §A.4), MOPD's accuracy after every stage and its final-metric bars.

The metrics are computed in :mod:`claas_verl.metrics` (numpy only); this shared glue draws them. Rendered with
matplotlib's object API on an Agg canvas: no display, no pyplot state, and the process-wide backend is left
untouched. matplotlib is imported inside each function, so importing this module stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from claas_verl.metrics.matrix import as_matrix


def plot_transfer_heatmap(M: Any, path: str | Path, title: str | None = None, vmin: float = 0.0,
                          vmax: float = 1.0, dpi: int = 100) -> Path:
    """Write M (rows: checkpoint after split j; cols: evaluated split k) as an annotated PNG heatmap.

    Cells above the diagonal are forward transfer, below it retention (CLaaS paper App. B.1).
    Colour scale fixed to [vmin, vmax] (pass rates) so runs are comparable.
    """
    a = as_matrix(M)
    K = a.shape[0]
    side = 1.6 + 0.9 * K
    fig = new_figure(side + 1.2, side)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(a, cmap="viridis", vmin=vmin, vmax=vmax, origin="upper")
    for j in range(K):
        for k in range(K):
            v = a[j, k]
            ax.text(k, j, f"{v:.2f}", ha="center", va="center", fontsize=9,
                    color="black" if (v - vmin) > 0.6 * (vmax - vmin) else "white")
    ticks = np.arange(K)
    ax.set_xticks(ticks, [str(k + 1) for k in range(K)])
    ax.set_yticks(ticks, [str(j + 1) for j in range(K)])
    ax.set_xlabel("evaluated split k")
    ax.set_ylabel("checkpoint after split j")
    ax.set_title(title or "defender pass rate M[j, k]")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return save_png(fig, path, dpi)


def new_figure(width: float, height: float):
    """A matplotlib Figure on its own Agg canvas (no pyplot state, the process-wide backend untouched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | Path, dpi: int = 100) -> Path:
    """Lay out ``fig`` and write it as a PNG at ``path`` (folders made as needed); returns the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path


def accuracy_axis_top(curves: dict[str, dict[int, dict[str, list]]]) -> float:
    """Upper y limit of the stage-accuracy panels: the highest mean + half-width plus 0.05, at most 1.02."""
    tops = [c[0] + (c[1] or 0.0) for by_stage in curves.values() for row in by_stage.values() for c in row.values()
            if c[0] is not None]
    return min(1.02, max(tops, default=1.0) + 0.05)


def plot_stage_accuracy(curves: dict[str, dict[int, dict[str, list]]], domains: list[str], path: str | Path,
                        title: str = "task accuracy after each stage", dpi: int = 100) -> Path:
    """One panel per domain: accuracy after every stage, one line per method, error bars = the seed interval.

    ``curves[method][stage][domain] = [mean, half_width]`` (``claas_verl.metrics.benchmark.mean_stage_scores``);
    a missing half-width (one seed) draws no bar.
    """
    fig = new_figure(4.0 * len(domains) + 0.5, 3.6)
    axes = [fig.add_subplot(1, len(domains), i + 1) for i in range(len(domains))]
    stages = sorted({st for by_stage in curves.values() for st in by_stage})
    # one y range for every panel, fitted to the data (small scores stay readable), and each method shifted
    # sideways a little so that overlapping error bars stay apart
    top = accuracy_axis_top(curves)
    shift = {label: (i - (len(curves) - 1) / 2) * 0.05 for i, label in enumerate(curves)}
    for ax, d in zip(axes, domains):
        ax.set_xticks(stages)
        for label, by_stage in curves.items():
            xs = [st for st in sorted(by_stage) if d in by_stage[st]]
            if not xs:
                continue
            ms = [by_stage[st][d][0] for st in xs]
            hws = [by_stage[st][d][1] or 0.0 for st in xs]
            ax.errorbar([x + shift[label] for x in xs], ms, yerr=hws, marker="o", capsize=3, label=label)
        ax.set_title(d)
        ax.set_xlabel("after stage")
        ax.set_ylim(-0.02, top)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (reasoning-gym score)")
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle(title)
    return save_png(fig, path, dpi)


def plot_final_bars(summary: dict[str, dict[str, list]], keys: tuple[str, ...], path: str | Path,
                    dpi: int = 100) -> Path:
    """One bar panel per metric in ``keys`` (``summary[method][key] = [mean, half_width]``), error bars = the
    seed interval; a method without the metric (``[None, None]``, e.g. joint MOPD's forgetting) gets no bar."""
    fig = new_figure(4.2 * len(keys), 3.8)
    methods = list(summary)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        ms = [summary[m][key][0] for m in methods]
        hws = [summary[m][key][1] or 0.0 for m in methods]
        xs = np.arange(len(methods))
        ax.bar([x for x, v in zip(xs, ms) if v is not None], [v for v in ms if v is not None],
               yerr=[h for h, v in zip(hws, ms) if v is not None], capsize=4, color="tab:blue", alpha=0.8)
        for x, v in zip(xs, ms):
            if v is None:
                ax.text(x, 0.0, "n/a", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, methods, rotation=30, ha="right", fontsize=8)
        ax.set_title(key.replace("_", " "))
        ax.grid(axis="y", alpha=0.3)
    return save_png(fig, path, dpi)
