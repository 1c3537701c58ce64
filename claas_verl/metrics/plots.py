"""PNG heatmap of the checkpoint × split matrix M[j, k] (001 Fig. 5; SPEC A.4).

Rendered with matplotlib's object API on an Agg canvas: no display, no pyplot
state, and the process-wide backend is left untouched. matplotlib is imported
inside the function so importing :mod:`claas_verl.metrics` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def plot_transfer_heatmap(M: Any, path: str | Path, title: str | None = None, vmin: float = 0.0,
                          vmax: float = 1.0, dpi: int = 100) -> Path:
    """Write M (rows: checkpoint after split j; cols: evaluated split k) as an annotated PNG heatmap.

    Cells above the diagonal are forward transfer, below it retention (001 App. B.1).
    Colour scale fixed to [vmin, vmax] (pass rates) so runs are comparable.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from claas_verl.metrics.continual import _as_matrix

    a = _as_matrix(M)
    K = a.shape[0]
    side = 1.6 + 0.9 * K
    fig = Figure(figsize=(side + 1.2, side))
    FigureCanvasAgg(fig)
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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path
