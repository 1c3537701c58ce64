"""Merges without training (SPEC B.10): TIES (of experts, of snapshots, stage by stage) and the uniform average.

Torch-only math in :mod:`claas_verl.merges.ties`; Hugging Face safetensors directories in
:mod:`claas_verl.merges.io`; CLI ``python -m claas_verl.merges`` in :mod:`claas_verl.merges.cli`.
"""

from claas_verl.merges.io import SafetensorsDir, save_like
from claas_verl.merges.ties import (
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
