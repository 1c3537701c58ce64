"""The MOPD trainer's alignment plumbing (pure torch): ``mopd.signal`` parsing, driver regions, the padded
micro-batches that teacher and student rebuild identically, and the batch fingerprint."""

from __future__ import annotations

import pytest
import torch

from claas_verl.align import step_regions
from claas_verl.mopd.trainer.alignment import (
    REGION_IDS,
    WINDOW,
    AuxConfig,
    aux_config,
    aux_micro_batches,
    batch_fingerprint,
    check_layers,
    region_fields,
    response_regions,
)
from claas_verl.mopd.trainer.fields import response_ids


def test_signal_parsing_and_round_trip():
    fsar = aux_config({"sats": True, "vr": True, "hidden": True, "ratio": 0.5, "rho": 2.0, "window": 16,
                       "layers": "all"})
    assert fsar.terms == ("sats", "vr", "hidden") and fsar.layers is None and fsar.combine == "fsar"
    # docs/math.md §B.6/B.8: replay steps only; recovery steps use the token loss only
    assert fsar.applies_to("replay") and not fsar.applies_to("recovery") and not fsar.applies_to("new")
    assert aux_config({"hidden": True, "aux_kinds": ["replay", "recovery"]}).applies_to("recovery")
    with pytest.raises(ValueError, match="mopd.signal.aux_kinds"):
        aux_config({"hidden": True, "aux_kinds": ["new"]})
    one = aux_config({"sats": True, "hidden": True, "combine": "1:1:1"})
    assert AuxConfig.from_dict(one.to_dict()) == one
    with pytest.raises(ValueError, match="1:1:1"):
        aux_config({"sats": True, "vr": True, "hidden": True, "combine": "1:1:1"})
    with pytest.raises(ValueError, match="mopd.signal.combine"):
        aux_config({"sats": True, "combine": "gradnorm"})
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
    one = aux_micro_batches(seqs, rid, win, lens, [[0, 1]])
    assert len(one) == 1
    mb = one[0]
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert mb.regions.region_ids.tolist() == [[-1, -1, 0, 0, 1], [-1, 0, 0, -1, -1]]
    assert mb.regions.num_regions.tolist() == [2, 1] and mb.n_resp == 2
    # split into single rows: same regions, each padded to its own length
    two = aux_micro_batches(seqs, rid, win, lens, [[1], [0]])  # any partition verl's engine chooses, in its order
    assert [m.input_ids.shape[1] for m in two] == [3, 5]
    assert two[0].regions.region_ids.tolist() == [[-1, 0, 0]]
    with pytest.raises(ValueError, match="response length 3 must be in"):
        aux_micro_batches([torch.tensor([1, 2, 3]), seqs[1]], rid, win, lens, [[0, 1]])
    with pytest.raises(ValueError, match="exactly once"):
        aux_micro_batches(seqs, rid, win, lens, [[0], [0, 1]])


def test_fingerprint_is_order_and_content_sensitive():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    assert batch_fingerprint([a, b]) == batch_fingerprint([a.clone(), b.clone()])
    assert batch_fingerprint([a, b]) != batch_fingerprint([b, a])
    assert batch_fingerprint([a, b]) != batch_fingerprint([torch.tensor([1, 2]), torch.tensor([3, 4, 5])])


SEP, EOS = 7, 2


def test_regions_from_the_trainer_fields_use_the_response_ids_not_the_shifted_ones():
    """docs/math.md §B.4 through the trainer's plumbing: verl's nested input_ids/response_mask -> region_fields (what
    the
    driver stores) -> the worker's padded micro-batch (what teacher and student pool over)."""
    from verl.utils import tensordict_utils as tu

    from claas_verl.mopd.trainer.balanced_passes import micro_batches as _micro_batches

    prompt, response = [5, 6, 9], [11, 12, SEP, 13, 14, SEP, 15, EOS]
    other_prompt, other_response = [4], [SEP, 21, SEP]
    nest = lambda xs: torch.nested.as_nested_tensor([torch.tensor(x) for x in xs], layout=torch.jagged)  # noqa: E731
    input_ids = nest([prompt + response, other_prompt + other_response])
    mask = nest([[1] * len(response), [1] * len(other_response)])
    fields, rid, win = region_fields(input_ids, mask, {SEP}, aux_config({"sats": True, "window": 100}))
    # hand-made regions: [11, 12, SEP] [13, 14, SEP] [15, EOS]; [SEP] [21, SEP]
    assert rid[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert rid[1, :3].tolist() == [0, 1, 1]
    assert [r.tolist() for r in fields[REGION_IDS].unbind()] == [[0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 1]]
    assert [w.tolist() for w in fields[WINDOW].unbind()] == [[1] * 8, [1] * 3]
    data = tu.get_tensordict({"input_ids": input_ids, "response_mask": mask, **fields})
    (mb,) = _micro_batches(data, [[0, 1]])
    assert mb.regions.region_ids[0].tolist() == [-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2]
    assert mb.regions.region_ids[1].tolist() == [-1, 0, 1, 1] + [-1] * 7
    assert mb.regions.num_regions.tolist() == [3, 2]
    # what the shifted ids (verl's response_from_nested, right for log-probs only) would have given
    from verl.workers.utils.padding import response_from_nested

    shifted = response_from_nested(input_ids, mask).to_padded_tensor(0)
    wrong, _ = response_regions(shifted, mask.to_padded_tensor(0), {SEP}, aux_config({"sats": True, "window": 100}))
    assert wrong[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2]


def test_response_ids_are_the_last_response_length_tokens():
    nest = lambda xs: torch.nested.as_nested_tensor([torch.tensor(x) for x in xs], layout=torch.jagged)  # noqa: E731
    ids = response_ids(nest([[1, 2, 3, 4], [5, 6]]), nest([[1, 1], [1]]))
    assert [r.tolist() for r in ids.unbind()] == [[3, 4], [6]]
    with pytest.raises(ValueError, match="response length 2 must be in"):
        response_ids(nest([[1, 2]]), nest([[1, 1]]))
