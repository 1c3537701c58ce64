"""The shared logits-processor loss seam (claas_verl.verl_ext.logits_loss) and the top-K field layouts it reads
(claas_verl.verl_ext.topk_fields, claas_verl.verl_ext.packed_batch), on a hand-derived 2-sequence packed batch; the
hand-off of the processor's outputs past verl's output handling, through verl's own micro-batching and reorder."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from claas_verl.verl_ext.logits_loss import SLOT_FIELD, SP_SETTING, LogitsProcessorLoss, gather_response_rows
from claas_verl.verl_ext.packed_batch import gather_packed_to_response, response_positions, scatter_response_to_packed
from claas_verl.verl_ext.topk_fields import pack_row_list, pack_rows, unpack_rows

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
        return {"x": logits[..., :2]}

    def compute_loss(self, model_output, data, dp_group=None, packed=None):
        self.calls.append(("loss", dp_group))
        self.packed = packed
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


def test_response_rows_is_differentiable_and_reads_only_the_predicting_positions():
    leaf = torch.randn(sum(SEQ) + 2, 3, requires_grad=True)  # + verl's tail padding of the packed sequence
    out = _Recording().response_rows(leaf[None], _batch())
    assert out.shape == (2, 3, 3)
    assert torch.equal(out[1, 1].detach(), leaf[9].detach()) and not out[1, 2].any()
    out[..., [0, 2]].sum().backward()
    touched = leaf.grad.abs().sum(-1).nonzero().view(-1).tolist()
    assert touched == PREDICTING and not leaf.grad[:, 1].any()


def test_the_processor_hands_its_outputs_to_the_loss_of_the_same_micro_batch_and_verl_gets_one_field():
    fn, data = _Recording(), _batch()
    logits = torch.randn(1, sum(SEQ), V, requires_grad=True)
    out = fn(student_logits=logits, data=data)
    assert fn.calls == ["check", "process"]
    # one int64 value per packed token, as verl's prepare_model_outputs asserts
    assert sorted(out) == [SLOT_FIELD] and out[SLOT_FIELD].shape == (1, sum(SEQ))
    assert out[SLOT_FIELD].dtype == torch.int64
    fn.calls.clear()
    fn(model_output=out, data=data, dp_group="g")
    assert fn.calls == ["check", ("loss", "g")]
    assert sorted(fn.packed) == ["x"] and fn.packed["x"].requires_grad  # the processor's tensor, with grad
    assert torch.equal(fn.packed["x"].detach(), logits[..., :2].detach())
    with pytest.raises(ValueError, match=r"\[1, N, V\]"):
        fn(student_logits=torch.randn(2, 3, V), data=_batch())


def test_a_loss_call_without_its_own_processor_output_is_refused():
    fn = _Recording()
    with pytest.raises(ValueError, match="no processor output of its own micro-batch"):
        fn(model_output={}, data=_batch())  # no processor call at all
    fn(student_logits=torch.randn(1, sum(SEQ), V), data=_batch())
    with pytest.raises(ValueError, match="no processor output of its own micro-batch"):
        fn(model_output={}, data=_batch())  # another micro-batch than the processor's
    data = _batch()
    fn(student_logits=torch.randn(1, sum(SEQ), V), data=data)
    fn(model_output={}, data=data)
    with pytest.raises(ValueError, match="no processor output of its own micro-batch"):
        fn(model_output={}, data=data)  # taken once: a second loss call finds nothing
    fn(student_logits=torch.randn(1, sum(SEQ) - 1, V), data=data)
    with pytest.raises(ValueError, match="saw 10 packed positions but .* 11 tokens"):
        fn(model_output={}, data=data)


class _RowProcessor(LogitsProcessorLoss):
    """Outputs that identify the token: [id, 1000·id + position-in-row] per packed position."""

    needed_by = "the row processor"

    def process_logits(self, logits, data):
        ids = data["input_ids"].values()
        pos = torch.cat([torch.arange(n) for n in data["input_ids"].offsets().diff().tolist()])
        return {"a": torch.stack([ids, 1000 * ids + pos], -1)[None], "b": -ids.float()[None, :, None]}

    def compute_loss(self, model_output, data, dp_group=None, packed=None):
        return torch.zeros(()), {}


def _verl_forward(fn, data):
    """What verl's forward_backward_batch does with a processor's fields: its own micro-batches (dynamic batch size:
    rows regrouped by length), per micro-batch the processor then the loss, each field nested over the micro-batch's
    rows, then postprocess_batch_func (concat over micro-batches, restore the batch's row order)."""
    from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

    micro, indices = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)
    assert indices is not None and len(micro) > 1 and [i for g in indices for i in g] != list(range(len(data)))
    outputs = []
    for mb in micro:
        fields = fn(student_logits=torch.zeros(1, int(mb["input_ids"].values().shape[0]), 2), data=mb)
        model_output = {k: torch.nested.nested_tensor_from_jagged(v[0], mb["input_ids"].offsets())
                        for k, v in fields.items()}
        loss, metrics = fn(model_output=model_output, data=mb)
        outputs.append({"model_output": model_output, "loss": float(loss), "metrics": metrics})
    return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)


def test_collected_outputs_come_back_in_the_batchs_row_order_through_verls_micro_batch_reorder():
    lens, resp = [9, 3, 7, 3, 8, 4], [4, 1, 5, 2, 3, 2]  # every row has a prompt token
    data = TensorDict({
        "input_ids": _nested(torch.arange(n) + 100 * (b + 1) for b, n in enumerate(lens)),
        "response_mask": _nested(torch.ones(r, dtype=torch.long) for r in resp),
    }, batch_size=[len(lens)])
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=12)
    fn = _RowProcessor()
    with fn.collecting() as kept:
        out = _verl_forward(fn, data)
        assert kept == {}  # filled on exit
    assert sorted(kept) == ["a", "b"] and kept["a"].shape == (sum(lens), 2) and fn._kept is None
    a = gather_response_rows(kept["a"], out["model_output"][SLOT_FIELD], data["response_mask"])
    b = gather_response_rows(kept["b"], out["model_output"][SLOT_FIELD], data["response_mask"])
    for row, (n, r) in enumerate(zip(lens, resp)):
        # row b's response token t is predicted at its position n - r - 1 + t
        positions = torch.arange(n - r - 1, n - 1)
        ids = positions + 100 * (row + 1)
        assert torch.equal(a[row].view(r, 2), torch.stack([ids, 1000 * ids + positions], -1))
        assert torch.equal(b[row], -ids.float())
    # nothing leaks into the next forward: outside collecting() nothing is kept
    fn(student_logits=torch.zeros(1, sum(SEQ), 2), data=_batch())
    assert fn._kept is None


def test_collecting_clears_its_buffer_when_the_forward_fails():
    fn = _RowProcessor()
    with pytest.raises(RuntimeError, match="boom"), fn.collecting():
        fn(student_logits=torch.zeros(1, sum(SEQ), 2), data=_batch())
        raise RuntimeError("boom")
    assert fn._kept is None and fn._pending is None


def test_sequence_parallel_batches_are_refused_naming_the_setting():
    from claas_verl.claas.trainer.sdpo_worker import ClaasSdpoLoss
    from claas_verl.mopd.trainer.loss import MOPDLoss

    sdpo = ClaasSdpoLoss({"topk": K}, actor_config=None)
    for fn, extra in ((_Recording(), {}), (sdpo, {}), (MOPDLoss(), {"mopd_phase": "teacher", "mopd_topk": K})):
        with pytest.raises(ValueError, match=f"sequence parallelism.*{SP_SETTING}=1"):
            fn(student_logits=torch.randn(1, sum(SEQ), V), data=_batch(sp_size=2, **extra))
    assert _Recording()(student_logits=torch.randn(1, sum(SEQ), V), data=_batch(sp_size=1))  # sp 1 passes


def test_a_loss_without_both_forms_cannot_be_built():
    class OnlyProcessor(LogitsProcessorLoss):
        def process_logits(self, logits, data):
            return {}

    with pytest.raises(TypeError, match="compute_loss"):
        OnlyProcessor()
