"""Metrics: CLaaS continual-learning metrics (SPEC A.4) and their plots."""

from claas_verl.metrics.continual import (
    ContinualMetrics,
    average_over_trials,
    continual_metrics,
    write_continual_metrics,
    write_matrix_csv,
)

__all__ = [
    "ContinualMetrics",
    "average_over_trials",
    "continual_metrics",
    "write_continual_metrics",
    "write_matrix_csv",
]
