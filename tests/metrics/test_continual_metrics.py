"""CLaaS continual metrics (docs/math.md §A.4) and their files: JSON and CSV (the PNG heatmap is drawn by the glue:
tests/utils/test_plots.py)."""

import csv
import json
import math

import numpy as np
import pytest

from claas_verl.metrics import average_over_trials, continual_metrics, write_continual_metrics

# rows = checkpoint after split j, cols = evaluated split k
M3 = [[0.5, 0.2, 0.1],
      [0.6, 0.7, 0.3],
      [0.4, 0.8, 0.9]]


def test_hand_computed_3x3():
    m = continual_metrics(M3)
    # FWT = 2/(K(K-1)) * (M[0,1] + M[0,2] + M[1,2]) = 2/6 * (0.2 + 0.1 + 0.3) = 0.6/3 = 0.2
    assert m.forward_transfer == pytest.approx(0.2, abs=1e-12)
    # Forgetting = 1/(K-1) * sum_{k<K-1} (max_{j>=k} M[j,k] - M[K-1,k])
    #   k=0: max(0.5, 0.6, 0.4) - 0.4 = 0.2 ;  k=1: max(0.7, 0.8) - 0.8 = 0.0  ->  (0.2 + 0.0)/2 = 0.1
    assert m.forgetting == pytest.approx(0.1, abs=1e-12)
    # Final = mean of the last row = (0.4 + 0.8 + 0.9)/3 = 0.7
    assert m.final == pytest.approx(0.7, abs=1e-12)


def test_orientation_rows_are_checkpoints():
    # transposing swaps the meaning: FWT would read the strictly upper triangle of M^T = (0.6 + 0.4 + 0.8)/3 = 0.6
    assert continual_metrics(np.array(M3).T).forward_transfer == pytest.approx(0.6, abs=1e-12)


def test_forgetting_terms_nonnegative_and_zero_when_monotone():
    # pass rates only ever improve: nothing is forgotten
    up = [[0.1, 0.0], [0.5, 0.6]]
    assert continual_metrics(up).forgetting == 0.0


def test_k1_is_nan_except_final():
    m = continual_metrics([[0.3]])
    assert math.isnan(m.forward_transfer) and math.isnan(m.forgetting)
    assert m.final == pytest.approx(0.3)


def test_average_over_trials_scores_each_trial_first():
    a = [[1.0, 0.0], [0.0, 0.0]]  # forgetting: max(1, 0) - 0 = 1
    b = [[0.0, 0.0], [1.0, 0.0]]  # forgetting: max(0, 1) - 1 = 0
    out = average_over_trials([a, b])
    assert out["forgetting"] == pytest.approx(0.5)  # (1 + 0)/2
    assert out["forgetting_std"] == pytest.approx(0.5)
    # the metrics of the mean matrix [[0.5, 0], [0.5, 0]] would give forgetting 0.5 - 0.5 = 0: not the same
    assert continual_metrics(out["mean_matrix"]).forgetting == pytest.approx(0.0)
    assert out["n_trials"] == 2 and len(out["per_trial"]) == 2
    assert math.isnan(average_over_trials([[[0.2]], [[0.4]]])["forward_transfer"])


@pytest.mark.parametrize("bad,msg", [
    ([[0.1, 0.2]], "square"),
    ([], "square"),
    ([[0.1, float("nan")], [0.2, 0.3]], "non-finite"),
])
def test_bad_matrix(bad, msg):
    with pytest.raises(ValueError, match=msg):
        continual_metrics(bad)


def test_trials_must_share_k():
    with pytest.raises(ValueError, match="same K"):
        average_over_trials([[[0.1]], M3])


def test_write_files(tmp_path):
    stats = {"max_uses": 26, "size": 12, "evicted_age": 40}
    extra = {"split_ids": [["a"], ["b"], ["c"]]}
    paths = write_continual_metrics(tmp_path / "run", M3, buffer_stats=stats, extra=extra)
    rec = json.loads(paths["json"].read_text())
    assert rec["M"] == M3 and rec["K"] == 3
    assert rec["forward_transfer"] == pytest.approx(0.2) and rec["forgetting"] == pytest.approx(0.1)
    assert rec["final"] == pytest.approx(0.7)
    assert rec["buffer_stats"] == stats and rec["split_ids"] == [["a"], ["b"], ["c"]]
    rows = list(csv.reader(paths["csv"].open()))
    assert rows[0] == ["checkpoint", "split_1", "split_2", "split_3"]
    assert rows[3] == ["ckpt_3", "0.4", "0.8", "0.9"]
    assert set(paths) == {"json", "csv"}  # the math draws no figure


def test_k1_json_writes_null_not_nan(tmp_path):
    paths = write_continual_metrics(tmp_path, [[0.25]])
    text = paths["json"].read_text()
    assert "NaN" not in text
    rec = json.loads(text)
    assert rec["forward_transfer"] is None and rec["forgetting"] is None and rec["final"] == 0.25
    assert "buffer_stats" not in rec


def test_reserved_keys_and_buffer_stats_type(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_continual_metrics(tmp_path, M3, extra={"final": 1.0})
    with pytest.raises(ValueError, match="buffer_stats"):
        write_continual_metrics(tmp_path, M3, buffer_stats=[1, 2])
