"""The weight-sync probe's parts: the fixed probe under the tiny student's tokenizer, and its two metrics."""

from __future__ import annotations

import pytest

from claas_verl.verl_ext.weight_probe import CHANGE_KEY, DIFF_KEY, probe_ids, probe_metrics


def test_probe_is_fixed_and_as_long_as_asked(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.student))
    ids = probe_ids(tok, 8)
    assert len(ids) == 9 and ids == probe_ids(tok, 8)
    with pytest.raises(ValueError, match="weight_sync_probe_tokens=0"):
        probe_ids(tok, 0)


def test_metrics_compare_served_with_trained_and_with_the_previous_sync():
    served = [([3, 4], [-1.0, -2.0]), ([3, 5], [-1.0, -2.5])]  # two replicas
    trained = [[-1.0, -2.00002], [-1.00001, -2.5]]
    m = probe_metrics(served, trained, None)
    assert m == pytest.approx({DIFF_KEY: 2e-5}) and CHANGE_KEY not in m  # no previous sync yet
    m = probe_metrics(served, trained, [[-1.0, -2.0], [-1.0, -2.0]])
    assert m[CHANGE_KEY] == pytest.approx(0.5)  # replica 2, position 2
    assert probe_metrics(served, trained, [[-1.0, -2.0], [-1.0, -2.5]])[CHANGE_KEY] == 0.0  # weights did not arrive


def test_a_negative_probe_length_names_the_key_and_zero_turns_the_probe_off():
    from claas_verl.verl_ext.weight_probe import WeightSyncProbe

    with pytest.raises(ValueError, match=r"mopd.weight_sync_probe_tokens=-1: .*0 turns the weight-sync check off"):
        WeightSyncProbe(-1)
    off = WeightSyncProbe(0)
    assert off.tokens == 0 and off.previous is None


def test_a_served_probe_that_is_not_the_trained_one_stops_the_job(caplog):
    import logging

    from claas_verl.metrics.served_check import ServedWeightsMismatch
    from claas_verl.verl_ext.weight_probe import WeightSyncProbe

    served = [([3, 4], [-1.0, -2.0]), ([3, 5], [-1.0, -2.5])]
    probe = WeightSyncProbe(8, 0.5)
    probe.check(served, [[-1.0, -2.00002], [-1.00001, -2.5]])  # rounding only: accepted
    with caplog.at_level(logging.ERROR, logger="claas_verl.metrics.served_check"):
        # replica 2 serves other weights: 0.7 nat apart on its second token
        with pytest.raises(ServedWeightsMismatch, match=r"mopd weight sync: .*max \|served - trained\| = 0.7 nat "
                                                          r"\(tolerance 0.5\)"):
            probe.check(served, [[-1.0, -2.0], [-1.0, -1.8]])
    assert "do not match the trained ones" in caplog.text
    WeightSyncProbe(8, None).check(served, [[0.0, 0.0], [0.0, 0.0]])  # null: the metrics are only logged
    # the CLaaS trainer's probe names its own section
    with pytest.raises(ServedWeightsMismatch, match=r"claas weight sync"):
        WeightSyncProbe(8, 0.5, system="claas").check(served, [[-1.0, -2.0], [-1.0, -1.8]])
    with pytest.raises(ValueError, match=r"claas.weight_sync_probe_tokens=-2"):
        WeightSyncProbe(-2, system="claas")
