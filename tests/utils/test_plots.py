"""The figures of the continual metrics (claas_verl/utils/plots.py): the M[j, k] heatmap and MOPD's stage curves."""

import struct

import numpy as np
import pytest

from claas_verl.metrics.continual import HEATMAP_PNG
from claas_verl.utils.plots import accuracy_axis_top, plot_final_bars, plot_stage_accuracy, plot_transfer_heatmap

# rows = checkpoint after split j, cols = evaluated split k
M3 = [[0.5, 0.2, 0.1],
      [0.6, 0.7, 0.3],
      [0.4, 0.8, 0.9]]


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24]), len(data)


def test_heatmap_of_the_record(tmp_path):
    p = plot_transfer_heatmap(M3, tmp_path / "run" / HEATMAP_PNG, title="CLaaS sdpo: M[j, k]")
    assert p == tmp_path / "run" / "continual_matrix.png"
    (w, h), n_bytes = _png_size(p)
    assert w >= 200 and h >= 200 and n_bytes > 2000


def test_heatmap_5x5_and_backend_untouched(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    rng = np.random.default_rng(0)
    p = plot_transfer_heatmap(rng.uniform(size=(5, 5)), tmp_path / "deep" / "m.png", title="tiny")
    (w, h), n_bytes = _png_size(p)
    assert w > h  # colour bar on the right
    assert matplotlib.get_backend() == before


def test_stage_accuracy_axis_fits_small_scores_and_caps_at_one(tmp_path):
    curves = {"Seq": {1: {"spell": [0.31, 0.05]}, 2: {"spell": [0.17, None], "reverse": [0.0, 0.0]}},
              "Replay": {1: {"spell": [0.30, None]}, 2: {"spell": [0.30, 0.10]}}}
    assert accuracy_axis_top(curves) == pytest.approx(0.45)  # 0.30 + 0.10 + 0.05
    assert accuracy_axis_top({"a": {1: {"d": [0.99, 0.2]}}}) == 1.02
    assert accuracy_axis_top({}) == 1.02
    p = plot_stage_accuracy(curves, ["spell", "reverse"], tmp_path / "acc.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_final_bars_leave_out_a_missing_metric(tmp_path):
    summary = {"Seq": {"final_avg": [0.4, 0.05], "forgetting": [0.1, None]},
               "Joint": {"final_avg": [0.5, None], "forgetting": [None, None]}}  # joint MOPD has no forgetting
    p = plot_final_bars(summary, ("final_avg", "forgetting"), tmp_path / "bars.png")
    (w, h), _ = _png_size(p)
    assert w > h  # one panel per metric, side by side

