"""The MOPD trainer's alignment plumbing (pure torch): ``mopd.signal`` parsing, driver regions, the padded
micro-batches that teacher and student rebuild identically, and the batch fingerprint."""

from __future__ import annotations

import pytest
import torch

from claas_verl.align import step_regions
from claas_verl.trainer.mopd.alignment import (
    AuxConfig,
    aux_config,
    aux_micro_batches,
    batch_fingerprint,
    check_layers,
    response_regions,
)


def test_signal_parsing_and_round_trip():
    fsar = aux_config({"sats": True, "vr": True, "hidden": True, "ratio": 0.5, "rho": 2.0, "window": 16,
                       "layers": "all"}, micro_batch_size=3)
    assert fsar.terms == ("sats", "vr", "hidden") and fsar.layers is None and fsar.micro_batch_size == 3
    assert fsar.applies_to("replay") and fsar.applies_to("recovery") and not fsar.applies_to("new")
    assert AuxConfig.from_dict(fsar.to_dict()) == fsar
    kl = aux_config({"sats": False, "vr": False, "hidden": False})
    assert not kl.enabled and not kl.applies_to("replay")
    sats = aux_config({"sats": True, "layers": [27, 6, 13, 20]})
    assert sats.layers == (6, 13, 20, 27)
    assert check_layers(sats, 28) == [6, 13, 20, 27]
    with pytest.raises(ValueError, match="out of range for a 2-layer model"):
        check_layers(sats, 2)
    with pytest.raises(ValueError, match="mopd.signal.vr=true needs mopd.signal.sats=true"):
        aux_config({"vr": True})
    with pytest.raises(ValueError, match="mopd.signal.ratio"):
        aux_config({"hidden": True, "ratio": 0})
    with pytest.raises(ValueError, match="mopd.signal.window"):
        aux_config({"hidden": True, "window": 0})


def test_driver_regions_are_step_regions():
    resp = torch.tensor([[3, 9, 4, 9, 5], [9, 1, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    cfg = aux_config({"sats": True, "window": 4})
    rid, win = response_regions(resp, mask, {9}, cfg)
    ref = step_regions(resp, mask, {9}, window=4)
    assert torch.equal(rid, ref.region_ids) and torch.equal(win.bool(), ref.window_mask)
    # row 0: window = last 4 tokens [9, 4, 9, 5]: separator 9 closes region 0, region 1 = [4, 9], region 2 = [5]
    assert rid[0].tolist() == [-1, 0, 1, 1, 2]


def test_micro_batches_place_response_regions_at_sequence_positions():
    # two sequences: prompt [1, 2] + response [3, 4, 5]; prompt [6] + response [7, 8]
    seqs = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8])]
    rid = torch.tensor([[0, 0, 1], [0, -1, -1]])  # row 1 padded beyond its 2 response tokens... and one off-window
    rid[1, 1] = 0
    win = (rid >= 0).long()
    lens = torch.tensor([3, 2])
    one = aux_micro_batches(seqs, rid, win, lens, micro_batch_size=8)
    assert len(one) == 1
    mb = one[0]
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert mb.regions.region_ids.tolist() == [[-1, -1, 0, 0, 1], [-1, 0, 0, -1, -1]]
    assert mb.regions.num_regions.tolist() == [2, 1] and mb.n_resp == 2
    # split into single rows: same regions, each padded to its own length
    two = aux_micro_batches(seqs, rid, win, lens, micro_batch_size=1)
    assert [m.input_ids.shape[1] for m in two] == [5, 3]
    assert two[1].regions.region_ids.tolist() == [[-1, 0, 0]]
    with pytest.raises(ValueError, match="response length 3 must be in"):
        aux_micro_batches([torch.tensor([1, 2, 3]), seqs[1]], rid, win, lens, 8)


def test_fingerprint_is_order_and_content_sensitive():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    assert batch_fingerprint([a, b]) == batch_fingerprint([a.clone(), b.clone()])
    assert batch_fingerprint([a, b]) != batch_fingerprint([b, a])
    assert batch_fingerprint([a, b]) != batch_fingerprint([torch.tensor([1, 2]), torch.tensor([3, 4, 5])])
