"""Merges without training (docs/math.md §B.10): TIES (of experts, of snapshots, stage by stage) and the uniform
average.

Torch-only math in :mod:`claas_verl.mopd.merges.ties`; Hugging Face safetensors directories in
:mod:`claas_verl.mopd.merges.io`; CLI ``python -m claas_verl.mopd.merges`` in :mod:`claas_verl.mopd.merges.cli`.
"""

from claas_verl.mopd.merges.io import SafetensorsDir, save_like
from claas_verl.mopd.merges.ties import (
    THRESHOLD_METHODS,
    disjoint_mean,
    elect_sign,
    iter_ties_merge,
    iter_ties_stagewise,
    ties_merge,
    ties_merge_flat,
    ties_stagewise,
    trim,
    trim_k,
    trim_thresholds,
    uniform_average,
)

__all__ = [
    "THRESHOLD_METHODS",
    "SafetensorsDir",
    "disjoint_mean",
    "elect_sign",
    "iter_ties_merge",
    "iter_ties_stagewise",
    "save_like",
    "ties_merge",
    "ties_merge_flat",
    "ties_stagewise",
    "trim",
    "trim_k",
    "trim_thresholds",
    "uniform_average",
]
