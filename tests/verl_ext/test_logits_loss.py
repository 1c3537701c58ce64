"""The shared logits-processor loss seam (claas_verl.verl_ext.logits_loss) and the top-K field layouts it reads
(claas_verl.verl_ext.topk_fields, claas_verl.verl_ext.packed_batch), on a hand-derived 2-sequence packed batch."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from claas_verl.verl_ext.logits_loss import SP_SETTING, LogitsProcessorLoss
from claas_verl.verl_ext.packed_batch import gather_packed_to_response, response_positions, scatter_response_to_packed
from claas_verl.verl_ext.topk_fields import names, pack_row_list, pack_rows, split_last, unpack_rows

# sequence 0: prompt 2 + response 3 = packed 0..4 (response tokens at 2, 3, 4, predicted at 1, 2, 3);
# sequence 1: prompt 4 + response 2 = packed 5..10 (response tokens at 9, 10, predicted at 8, 9).
SEQ, RESP, K, V = [5, 6], [3, 2], 2, 6
PREDICTING = [1, 2, 3, 8, 9]


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def _batch(**non_tensor) -> TensorDict:
    td = TensorDict({
        "input_ids": _nested(torch.arange(n) + 10 * b for b, n in enumerate(SEQ)),
        "response_mask": _nested(torch.ones(r, dtype=torch.long) for r in RESP),
        # ids of response token t of row b, candidate j: 10·b + 2·t + j (row 0: t < 3, row 1: t < 2)
        "ids": _nested(torch.tensor([10 * b + 2 * t + j for t in range(r) for j in range(K)]) for b, r in
                       enumerate(RESP)),
    }, batch_size=[2])
    tu.assign_non_tensor(td, **non_tensor)
    return td


class _Recording(LogitsProcessorLoss):
    needed_by = "the recording loss"

    def __init__(self):
        self.calls = []

    def check_batch(self, data):
        self.calls.append("check")

    def process_logits(self, logits, data):
        self.calls.append("process")
        return {"x": logits[..., 0]}

    def compute_loss(self, model_output, data, dp_group=None):
        self.calls.append(("loss", dp_group))
        return torch.zeros(()), {}


def test_response_positions_of_the_hand_derived_batch():
    idx, rows, cols = response_positions(torch.tensor(SEQ), torch.tensor(RESP))
    assert idx.tolist() == PREDICTING
    assert rows.tolist() == [0, 0, 0, 1, 1] and cols.tolist() == [0, 1, 2, 0, 1]


def test_flattened_rows_round_trip_and_pack_row_list_agrees_with_pack_rows():
    x = torch.arange(2 * 3 * K).view(2, 3, K) + 1
    packed = pack_rows(x, torch.tensor(RESP))
    assert packed.offsets().tolist() == [0, 6, 10]  # T_b·K values per row, one field
    assert torch.equal(packed.values(), pack_row_list([x[0], x[1, :2]]).values())
    back = unpack_rows(packed, K, "f")
    assert torch.equal(back[0], x[0]) and torch.equal(back[1, :2], x[1, :2]) and not back[1, 2].any()
    with pytest.raises(ValueError, match="f has rows of .*claas.sdpo.topk=4"):
        unpack_rows(packed, 4, "f", "claas.sdpo.topk")
    with pytest.raises(ValueError, match="one K"):
        pack_row_list([torch.zeros(2, 2), torch.zeros(1, 3)])
    assert names("p_", 2) == ["p_0", "p_1"] and sorted(split_last(x, "p_")) == ["p_0", "p_1"]


def test_scatter_and_gather_between_packed_and_response_layouts():
    values = torch.arange(2 * 3, dtype=torch.float32).view(2, 3) + 1  # [B, T_r]
    packed = scatter_response_to_packed(values, SEQ, RESP, total=sum(SEQ), fill=-1)
    assert packed.tolist() == [-1, 1, 2, 3, -1, -1, -1, -1, 4, 5, -1]
    back = gather_packed_to_response(packed, SEQ, RESP)
    assert back.tolist() == [[1, 2, 3], [4, 5, 0]]


def test_stored_ids_land_at_the_positions_predicting_each_response_token():
    ids = _Recording().stored_packed_ids(_batch(), "ids", K, sum(SEQ), "cpu")
    assert ids.shape == (1, sum(SEQ), K) and ids.dtype == torch.int64
    expect = torch.zeros(sum(SEQ), K, dtype=torch.long)
    for pos, (b, t) in zip(PREDICTING, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]):
        expect[pos] = torch.tensor([10 * b + 2 * t + j for j in range(K)])
    assert torch.equal(ids[0], expect)
    with pytest.raises(ValueError, match="another batch"):
        bad = _batch()
        bad["ids"] = _nested([torch.zeros(2 * K, dtype=torch.long), torch.zeros(2 * K, dtype=torch.long)])
        _Recording().stored_packed_ids(bad, "ids", K, sum(SEQ), "cpu")


def test_response_stack_is_differentiable_and_reads_only_the_predicting_positions():
    leaf = torch.randn(sum(SEQ), 3, requires_grad=True)
    cu = torch.tensor([0, SEQ[0], sum(SEQ)])
    model_output = {f"o{j}": torch.nested.nested_tensor_from_jagged(leaf[:, j], cu) for j in range(3)}
    out = _Recording().response_stack(model_output, ["o0", "o2"], _batch())
    assert out.shape == (2, 3, 2)
    assert torch.equal(out[1, 1].detach(), leaf[9, [0, 2]].detach()) and not out[1, 2].any()
    out.sum().backward()
    touched = leaf.grad.abs().sum(-1).nonzero().view(-1).tolist()
    assert touched == PREDICTING and not leaf.grad[:, 1].any()


def test_the_two_call_forms_dispatch_and_the_batch_check_runs_before_each():
    fn = _Recording()
    out = fn(student_logits=torch.randn(1, sum(SEQ), V), data=_batch())
    assert sorted(out) == ["x"] and fn.calls == ["check", "process"]
    fn.calls.clear()
    fn(model_output={}, data=_batch(), dp_group="g")
    assert fn.calls == ["check", ("loss", "g")]
    with pytest.raises(ValueError, match=r"\[1, N, V\]"):
        fn(student_logits=torch.randn(2, 3, V), data=_batch())


def test_sequence_parallel_batches_are_refused_naming_the_setting():
    from claas_verl.claas.trainer.sdpo_worker import ClaasSdpoLoss
    from claas_verl.mopd.trainer.loss import MOPDLoss

    sdpo = ClaasSdpoLoss({"topk": K}, actor_config=None)
    for fn, extra in ((_Recording(), {}), (sdpo, {}), (MOPDLoss(), {"mopd_phase": "teacher", "mopd_topk": K})):
        with pytest.raises(ValueError, match=f"sequence parallelism.*{SP_SETTING}=1"):
            fn(student_logits=torch.randn(1, sum(SEQ), V), data=_batch(sp_size=2, **extra))
    assert _Recording()(student_logits=torch.randn(1, sum(SEQ), V), data=_batch(sp_size=1))  # sp 1 passes
