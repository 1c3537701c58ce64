"""The K×K transfer matrix of a continual run (rows checkpoints, columns splits), checked once for every
metric and plot that reads it. Numpy only."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_matrix(M: Any, name: str = "M") -> np.ndarray:
    a = np.asarray(M, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise ValueError(f"{name} must be a non-empty square K×K matrix (rows checkpoints, cols splits), "
                         f"got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} has non-finite entries at {np.argwhere(~np.isfinite(a)).tolist()[:5]}; "
                         "every checkpoint must be evaluated on every split")
    return a
