"""Continual-learning metrics of CLaaS (docs/math.md §A.4, CLaaS paper §4) and their on-disk record.

``M`` is K×K with ``M[j, k]`` = mean defender pass rate of the checkpoint saved
after split j, evaluated on split k (rows = checkpoints, columns = splits; 0-based
here, 1-based in docs/math.md §A.4). With K ≥ 2:

    FWT        = 2/(K(K−1)) · Σ_{j<k} M[j,k]                                 strictly upper triangle
    Forgetting = 1/(K−1) · Σ_{k=1}^{K−1} ( max_{j∈{k..K}} M[j,k] − M[K,k] )  each term ≥ 0 (j = K included)
    Final      = 1/K · Σ_k M[K,k]                                            last row

K = 1: FWT and Forgetting are NaN (docs/math.md §A.4), Final = M[0, 0]. Numpy only (no torch,
ray or verl). Trials (CLaaS paper: 3 shuffles × 3 runs) are scored one by one and then
averaged (:func:`average_over_trials`), because the max in Forgetting does not
commute with averaging matrices.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from claas_verl.metrics.matrix import as_matrix

METRICS_JSON = "continual_metrics.json"
MATRIX_CSV = "continual_matrix.csv"
HEATMAP_PNG = "continual_matrix.png"  # drawn by claas_verl.utils.plots.plot_transfer_heatmap


@dataclass(frozen=True)
class ContinualMetrics:
    forward_transfer: float
    forgetting: float
    final: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def continual_metrics(M: Any) -> ContinualMetrics:
    """FWT, forgetting and final performance of one trial's K×K matrix (docs/math.md §A.4; see module docstring)."""
    a = as_matrix(M)
    K = a.shape[0]
    final = float(a[K - 1].mean())
    if K < 2:
        return ContinualMetrics(forward_transfer=math.nan, forgetting=math.nan, final=final)
    fwt = float(a[np.triu_indices(K, k=1)].sum() * 2.0 / (K * (K - 1)))
    # column k (k < K-1): best pass rate any checkpoint from k on reached, minus the last checkpoint's
    drops = [a[k:, k].max() - a[K - 1, k] for k in range(K - 1)]
    forgetting = float(np.sum(drops) / (K - 1))
    return ContinualMetrics(forward_transfer=fwt, forgetting=forgetting, final=final)


def average_over_trials(matrices: Sequence[Any]) -> dict[str, Any]:
    """Score each trial's matrix, then average (docs/math.md §A.4: per trial, then the mean over trials).

    Returns ``forward_transfer``/``forgetting``/``final`` (means), their ``*_std``
    (population std over trials), ``n_trials``, ``per_trial`` (list of dicts) and
    ``mean_matrix`` (the cell-wise mean, for the heatmap only: metrics of the mean
    matrix are not the mean metrics).
    """
    if len(matrices) == 0:
        raise ValueError("matrices must hold at least one trial's K×K matrix")
    mats = [as_matrix(m, f"matrices[{i}]") for i, m in enumerate(matrices)]
    if len({m.shape for m in mats}) != 1:
        raise ValueError(f"all trials must have the same K, got shapes {sorted({m.shape for m in mats})}")
    per = [continual_metrics(m).to_dict() for m in mats]
    out: dict[str, Any] = {"n_trials": len(mats), "per_trial": per, "mean_matrix": np.mean(mats, axis=0).tolist()}
    for key in ("forward_transfer", "forgetting", "final"):
        vals = np.array([p[key] for p in per])
        out[key] = float(vals.mean())  # NaN for K = 1, as per trial
        out[f"{key}_std"] = float(vals.std())
    return out


def _json_safe(x: Any) -> Any:
    # strict JSON has no NaN/Infinity: write null (K = 1 metrics), keep everything else as is
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return _json_safe(x.item())
    return x


def write_matrix_csv(M: Any, path: str | Path) -> Path:
    """CSV with a header ``checkpoint,split_1..split_K`` and one row per checkpoint (``ckpt_1..ckpt_K``)."""
    a = as_matrix(M)
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["checkpoint"] + [f"split_{k + 1}" for k in range(a.shape[1])])
        for j, row in enumerate(a):
            w.writerow([f"ckpt_{j + 1}"] + [repr(float(v)) for v in row])
    return path


def write_continual_metrics(out_dir: str | Path, M: Any, buffer_stats: dict | None = None,
                            extra: dict | None = None) -> dict[str, Path]:
    """Write ``continual_metrics.json`` and the CSV of M into ``out_dir``.

    JSON keys: ``M`` (list of rows), ``K``, ``forward_transfer``, ``forgetting``, ``final``
    (null when NaN, i.e. K = 1), ``buffer_stats`` (the dict given, e.g. the replay
    buffer's statistics including the most updates any entry was used in) and any
    ``extra`` keys (e.g. split ids, seeds, ``average_over_trials`` output).
    Returns the written paths by kind (``json``, ``csv``). The heatmap ``continual_matrix.png`` beside them is
    drawn by the glue (:func:`claas_verl.utils.plots.plot_transfer_heatmap`), so the math needs no matplotlib.
    """
    a = as_matrix(M)
    if buffer_stats is not None and not isinstance(buffer_stats, dict):
        raise ValueError(f"buffer_stats must be a dict or None, got {type(buffer_stats).__name__}")
    if extra is not None:
        clash = {"M", "K", "forward_transfer", "forgetting", "final", "buffer_stats"} & set(extra)
        if clash:
            raise ValueError(f"extra must not override the reserved keys {sorted(clash)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"M": a.tolist(), "K": int(a.shape[0]), **continual_metrics(a).to_dict()}
    if buffer_stats is not None:
        record["buffer_stats"] = buffer_stats
    record.update(extra or {})
    paths = {"json": out_dir / METRICS_JSON, "csv": out_dir / MATRIX_CSV}
    paths["json"].write_text(json.dumps(_json_safe(record), indent=2, allow_nan=False) + "\n")
    write_matrix_csv(a, paths["csv"])
    return paths
