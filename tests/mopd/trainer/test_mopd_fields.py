"""Packing of the K per-token fields (claas_verl.mopd.trainer.fields): layouts, shifts, round trips."""

from __future__ import annotations

import pytest
import torch

from claas_verl.mopd.trainer import fields as token_fields


def test_response_positions_left_shift_by_one():
    # seq 0: prompt 3 + response 2 -> packed [0..4], response tokens at packed 3,4 are predicted at 2,3
    # seq 1: prompt 2 + response 3 -> packed [5..9], response tokens at 7,8,9 are predicted at 6,7,8
    idx, rows, cols = token_fields.response_positions(torch.tensor([5, 5]), torch.tensor([2, 3]))
    assert idx.tolist() == [2, 3, 6, 7, 8]
    assert rows.tolist() == [0, 0, 1, 1, 1]
    assert cols.tolist() == [0, 1, 0, 1, 2]


def test_scatter_then_gather_round_trip_and_fill():
    seq, resp = torch.tensor([5, 4]), torch.tensor([2, 3])
    values = torch.arange(2 * 3 * 2).view(2, 3, 2).float()  # [B=2, T=3, K=2]
    packed = token_fields.scatter_response_to_packed(values, seq, resp, total=10, fill=-1)
    assert packed.shape == (10, 2)
    # prompt positions and the last token of each sequence keep the fill value
    assert packed[0].tolist() == [-1, -1] and packed[4].tolist() == [-1, -1] and packed[9].tolist() == [-1, -1]
    back = token_fields.gather_packed_to_response(packed, seq, resp)
    assert back.shape == (2, 3, 2)
    assert torch.equal(back[0, :2], values[0, :2]) and torch.equal(back[1], values[1])
    assert back[0, 2].tolist() == [0.0, 0.0]  # padding of the shorter response is zero


def test_gather_is_differentiable():
    seq, resp = torch.tensor([3]), torch.tensor([2])
    packed = torch.randn(3, 4, requires_grad=True)
    token_fields.gather_packed_to_response(packed, seq, resp).sum().backward()
    # only the two positions predicting response tokens (packed 0 and 1) receive a gradient
    assert packed.grad[:2].eq(1).all() and packed.grad[2].eq(0).all()


def test_bad_lengths_are_rejected():
    with pytest.raises(ValueError, match="non-empty prompt"):
        token_fields.response_positions(torch.tensor([2]), torch.tensor([2]))
    with pytest.raises(ValueError, match=">= 1"):
        token_fields.unpack_rows(token_fields.pack_rows(torch.zeros(1, 2, 3), torch.tensor([2])), 0)


def test_pack_rows_round_trip_keeps_each_rows_values_in_order_and_pads_with_zeros():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4) + 1
    packed = token_fields.pack_rows(x, torch.tensor([3, 1]))
    assert packed.is_nested and packed.offsets().tolist() == [0, 12, 16]  # one field: T_b * K values per row
    assert torch.equal(packed.values()[12:], x[1, 0])
    back = token_fields.unpack_rows(packed, 4, "f")
    assert back.shape == (2, 3, 4)
    assert torch.equal(back[0], x[0]) and torch.equal(back[1, 0], x[1, 0])
    assert not back[1, 1:].any()  # padding positions are zeros


def test_pack_rows_takes_lengths_from_a_nested_mask_and_unpack_refuses_another_kappa():
    mask = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(1)], layout=torch.jagged)
    packed = token_fields.pack_rows(torch.ones(2, 2, 3), mask)
    assert packed.offsets().tolist() == [0, 6, 9]
    with pytest.raises(ValueError, match="mopd_adv.*mopd.train.topk=4"):
        token_fields.unpack_rows(packed, 4, token_fields.ADVANTAGES)
    with pytest.raises(ValueError, match="do not fit"):
        token_fields.pack_rows(torch.ones(2, 2, 3), torch.tensor([3, 1]))
