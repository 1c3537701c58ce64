"""The worker writes a forward-only pass's top-κ outputs as one TransferQueue field per quantity
(claas_verl.mopd.trainer.workers.fold_topk_outputs): values, the left shift, verl's row reorder, and what it leaves
alone."""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu

from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer.workers import fold_topk_outputs
from claas_verl.verl_ext.logits_loss import SLOT_FIELD

K = 3
SEQ = [5, 4]  # prompt + response length of each row
RESP = [2, 3]


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _mask(resp=RESP):
    return _nested([torch.ones(r, dtype=torch.long) for r in resp])


def _kept(seq=SEQ, k=K, dtype=torch.float32):
    # value at packed position of row b, sequence position i, candidate j: 100 b + 10 j + i
    return torch.cat([torch.tensor([[100 * b + 10 * j + i for j in range(k)] for i in range(n)], dtype=dtype)
                      for b, n in enumerate(seq)])


def _output(seq=SEQ, order=None):
    """verl's output of the forward: the one slot field (packed position of each row's tokens), rows in ``order``
    of the packed buffer (verl's micro-batch reorder already undone), plus a plain field and metrics."""
    starts = torch.tensor([0, *seq]).cumsum(0).tolist()
    slots = [torch.arange(starts[b], starts[b] + seq[b]) for b in range(len(seq))]
    order = order or list(range(len(seq)))
    fields = {SLOT_FIELD: _nested([slots[b] for b in order]), "log_probs": _nested([torch.zeros(seq[b])
                                                                                     for b in order])}
    return tu.get_tensordict(tensor_dict=fields, non_tensor_dict={"metrics": {"loss": 1.0}})


def test_fold_takes_each_rows_response_positions_left_shifted_by_one():
    kept = {token_fields.TOPK_IDS: _kept(dtype=torch.int64), token_fields.STUDENT_LP: _kept()}
    out = fold_topk_outputs(_output(), _mask(), kept, K)
    assert SLOT_FIELD not in out.keys()
    assert token_fields.TOPK_IDS in out.keys() and token_fields.STUDENT_LP in out.keys() and "log_probs" in out.keys()
    assert tu.get_non_tensor_data(out, "metrics", None) == {"loss": 1.0}
    assert out[token_fields.TOPK_IDS].dtype == torch.int64 and out[token_fields.STUDENT_LP].dtype == torch.float32
    for name in (token_fields.TOPK_IDS, token_fields.STUDENT_LP):
        x = token_fields.unpack_rows(out[name], K, name)
        assert x.shape == (2, 3, K)
        # response token t of row b is predicted at sequence position SEQ[b] - RESP[b] - 1 + t
        # row 0: positions 2, 3 (then zero padding); row 1: positions 0, 1, 2
        for b in range(2):
            for t in range(RESP[b]):
                assert x[b, t].tolist() == [100 * b + 10 * j + SEQ[b] - RESP[b] - 1 + t for j in range(K)]
        assert x[0, 2].tolist() == [0] * K


def test_fold_follows_the_slots_through_verls_row_reorder():
    # the packed buffer holds row 1 first (its micro-batch ran first); verl's output is back in batch order
    seq = [SEQ[1], SEQ[0]]  # rows of the packed buffer
    kept = {token_fields.TEACHER_LP: _kept(seq)}  # rows of the buffer: 0 = batch row 1, 1 = batch row 0
    out = fold_topk_outputs(_output(seq, order=[1, 0]), _mask(RESP), kept, K)
    assert sorted(k for k in out.keys() if k != "metrics") == sorted([token_fields.TEACHER_LP, "log_probs"])
    q = token_fields.unpack_rows(out[token_fields.TEACHER_LP], K)
    # batch row 0 (buffer row 1, 5 tokens, 2 response): positions 2, 3 -> 100 + 10 j + i
    assert q[0, 0].tolist() == [102, 112, 122] and q[0, 1].tolist() == [103, 113, 123]
    # batch row 1 (buffer row 0): positions 0, 1, 2 -> 10 j + i
    assert q[1, 0].tolist() == [0, 10, 20] and q[1, 2].tolist() == [2, 12, 22]


def test_outputs_without_the_slot_field_pass_through():
    assert fold_topk_outputs(None, _mask(), {}, K) is None
    plain = tu.get_tensordict(tensor_dict={"log_probs": _nested([torch.zeros(n) for n in SEQ])})
    assert fold_topk_outputs(plain, _mask(), {token_fields.STUDENT_LP: _kept()}, K) is plain


def test_another_kappa_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="mopd.train.topk"):
        fold_topk_outputs(_output(), _mask(), {token_fields.STUDENT_LP: _kept(k=2)}, K)


def _reference_fold(fields, mask):
    """The fold as verl's own helpers spell it on K per-candidate fields: each field's response slice, padded,
    stacked, packed."""
    from verl.workers.utils.padding import response_from_nested

    cols = [response_from_nested(f, mask).to_padded_tensor(0) for f in fields]
    return token_fields.pack_rows(torch.stack(cols, dim=-1), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_fold_is_bit_identical_to_verls_per_field_response_slices(dtype):
    # a trainer-sized forward: 64 rows, kappa 128, one empty reply, random values (ids as int64), rows reordered
    g = torch.Generator().manual_seed(0)
    resp = [int(x) for x in torch.randint(0, 12, (64,), generator=g)]
    resp[5] = 0
    seq = [r + int(p) for r, p in zip(resp, torch.randint(3, 30, (64,), generator=g))]
    k = 128
    order = torch.randperm(64, generator=g).tolist()  # buffer row i holds batch row order[i]
    kept = (torch.randn(sum(seq), k, generator=g) * 50).to(dtype)
    starts = torch.tensor([0, *[seq[b] for b in order]]).cumsum(0).tolist()
    where = {b: i for i, b in enumerate(order)}
    slots = _nested([torch.arange(starts[where[b]], starts[where[b]] + seq[b]) for b in range(64)])
    # what verl handed back as K fields: field j row b = the buffer's column j at row b's slots
    fields = [_nested([kept[slots[b], j] for b in range(64)]) for j in range(k)]
    mask = _nested([torch.ones(r, dtype=torch.long) for r in resp])
    want = _reference_fold(fields, mask)
    out = tu.get_tensordict(tensor_dict={SLOT_FIELD: slots})
    got = fold_topk_outputs(out, mask, {token_fields.STUDENT_LP: kept}, k)[token_fields.STUDENT_LP]
    assert got.dtype == want.dtype
    assert torch.equal(got.offsets(), want.offsets()) and torch.equal(got.values(), want.values())
