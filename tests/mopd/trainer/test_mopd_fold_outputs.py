"""The worker folds K per-candidate logits-processor outputs into one TransferQueue field
(claas_verl.mopd.trainer.workers.fold_topk_outputs): values, the left shift, and what it leaves alone."""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu

from claas_verl.mopd.trainer import fields as F
from claas_verl.mopd.trainer.workers import fold_topk_outputs

K = 3
SEQ = [5, 4]  # prompt + response length of each row
RESP = [2, 3]


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _mask():
    return _nested([torch.ones(r, dtype=torch.long) for r in RESP])


def _field(j: int, dtype=torch.float32):
    # value at sequence position i of row b, candidate j: 100 b + 10 j + i
    return _nested([torch.tensor([100 * b + 10 * j + i for i in range(n)], dtype=dtype) for b, n in enumerate(SEQ)])


def _output(prefixes, k=K):
    fields = {f"{p}{j}": _field(j) for p in prefixes for j in range(k)}
    fields["log_probs"] = _field(0)
    return tu.get_tensordict(tensor_dict=fields, non_tensor_dict={"metrics": {"loss": 1.0}})


def test_fold_takes_each_rows_response_positions_left_shifted_by_one():
    out = fold_topk_outputs(_output([F.STUDENT_IDS_PACKED, F.STUDENT_LP_PACKED]), _mask(), K)
    assert not any(k.startswith(("mopd_sid_packed_", "mopd_slp_packed_")) for k in out.keys())
    assert F.TOPK_IDS in out.keys() and F.STUDENT_LP in out.keys() and "log_probs" in out.keys()
    assert tu.get_non_tensor_data(out, "metrics", None) == {"loss": 1.0}
    for name in (F.TOPK_IDS, F.STUDENT_LP):
        x = F.unpack_rows(out[name], K, name)
        assert x.shape == (2, 3, K)
        # response token t of row b is predicted at sequence position SEQ[b] - RESP[b] - 1 + t
        # row 0: positions 2, 3 (then zero padding); row 1: positions 0, 1, 2
        for b in range(2):
            for t in range(RESP[b]):
                assert x[b, t].tolist() == [100 * b + 10 * j + SEQ[b] - RESP[b] - 1 + t for j in range(K)]
        assert x[0, 2].tolist() == [0] * K


def test_fold_of_the_teacher_forward_writes_q():
    out = fold_topk_outputs(_output([F.TEACHER_LP_PACKED]), _mask(), K)
    assert sorted(k for k in out.keys() if k != "metrics") == sorted([F.TEACHER_LP, "log_probs"])
    assert F.unpack_rows(out[F.TEACHER_LP], K)[1, 0].tolist() == [100, 110, 120]


def test_outputs_without_candidate_fields_pass_through():
    assert fold_topk_outputs(None, _mask(), K) is None
    plain = _output([])
    assert fold_topk_outputs(plain, _mask(), K) is plain
    assert fold_topk_outputs(plain, None, 0) is plain


def test_another_kappa_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="mopd.train.topk"):
        fold_topk_outputs(_output([F.STUDENT_LP_PACKED], k=2), _mask(), K)


def _reference_fold(fields, mask):
    """The fold as verl's own helpers spell it: each field's response slice, padded, stacked, packed."""
    from verl.workers.utils.padding import response_from_nested

    cols = [response_from_nested(f, mask).to_padded_tensor(0) for f in fields]
    return F.pack_rows(torch.stack(cols, dim=-1), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_fold_is_bit_identical_to_verls_per_field_response_slices(dtype):
    # a trainer-sized forward: 64 rows, kappa 128, one empty reply, random values (ids as int64)
    g = torch.Generator().manual_seed(0)
    resp = [int(x) for x in torch.randint(0, 12, (64,), generator=g)]
    resp[5] = 0
    seq = [r + int(p) for r, p in zip(resp, torch.randint(3, 30, (64,), generator=g))]
    k = 128
    fields = {f"{F.STUDENT_LP_PACKED}{j}": _nested([(torch.randn(n, generator=g) * 50).to(dtype) for n in seq])
              for j in range(k)}
    mask = _nested([torch.ones(r, dtype=torch.long) for r in resp])
    want = _reference_fold(list(fields.values()), mask)
    got = fold_topk_outputs(tu.get_tensordict(tensor_dict=dict(fields)), mask, k)[F.STUDENT_LP]
    assert got.dtype == want.dtype
    assert torch.equal(got.offsets(), want.offsets()) and torch.equal(got.values(), want.values())


def test_fields_of_different_row_layouts_are_refused():
    other = _nested([torch.zeros(n) for n in (4, 5)])  # the rows of _field() swapped
    out = _output([F.TEACHER_LP_PACKED])
    out[f"{F.TEACHER_LP_PACKED}1"] = other
    with pytest.raises(ValueError, match="different row layouts"):
        fold_topk_outputs(out, _mask(), K)
