"""The loss/logits-processor installed on MOPD engines (claas_verl.mopd.trainer.loss.MOPDLoss), on a micro-batch
shaped exactly like verl's no-padding batches: packed logits in, per-token fields out, and the update loss
equal to eq. (5) computed directly on the response layout."""

from __future__ import annotations

import types

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from claas_verl.distill import student_topk, teacher_logprobs_at
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer.loss import MOPDLoss
from claas_verl.verl_ext.logits_loss import SLOT_FIELD

K, V = 3, 11
PROMPTS, RESPONSES = [3, 2], [2, 3]  # sequence lengths 5 and 5 -> 10 packed tokens
SEQ = [p + r for p, r in zip(PROMPTS, RESPONSES)]


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def _batch(phase: str, extra: dict | None = None, **non_tensor) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    input_ids = _nested(torch.randint(0, V, (n,), generator=g) for n in SEQ)
    td = TensorDict({
        "input_ids": input_ids,
        "response_mask": _nested(torch.ones(r, dtype=torch.long) for r in RESPONSES),
        **(extra or {}),
    }, batch_size=[2])
    tu.assign_non_tensor(td, **{token_fields.PHASE_KEY: phase, token_fields.TOPK_KEY: K, "dp_size": 1,
                                "batch_num_tokens": sum(RESPONSES), "global_batch_size": 2, **non_tensor})
    return td


def _ids_fields(ids_resp):
    # response-layout ids [B, T_r, K] -> one flattened-rows field, as the trainer stores them
    return {token_fields.TOPK_IDS: token_fields.pack_rows(ids_resp, torch.tensor(RESPONSES))}


def _packed_idx():
    idx, _, _ = token_fields.response_positions(torch.tensor(SEQ), torch.tensor(RESPONSES))
    return idx  # packed positions predicting response tokens: [2, 3, 6, 7, 8]


def _forward_only(fn, logits, data) -> dict:
    """One micro-batch through both call forms inside ``collecting()``: the kept processor outputs [N, K]."""
    with fn.collecting() as kept:
        slots = fn(student_logits=logits, data=data)
        assert sorted(slots) == [SLOT_FIELD] and slots[SLOT_FIELD].shape == (1, sum(SEQ))  # verl: one per token
        loss, metrics = fn(model_output=slots, data=data)
        assert float(loss) == 0.0 and metrics == {}
    return kept


def _update_forward(fn, logits, data):
    """The processor then the loss on one micro-batch, as verl's forward_step calls them."""
    slots = fn(student_logits=logits, data=data)
    cu = data["input_ids"].offsets()
    return fn(model_output={k: torch.nested.nested_tensor_from_jagged(v[0], cu) for k, v in slots.items()}, data=data)


def test_student_phase_returns_topk_per_packed_token():
    logits = torch.randn(1, sum(SEQ), V)
    out = _forward_only(MOPDLoss(), logits, _batch(token_fields.PHASE_STUDENT_TOPK))
    ids, lp = student_topk(logits, K)
    assert sorted(out) == sorted([token_fields.TOPK_IDS, token_fields.STUDENT_LP])
    assert torch.equal(out[token_fields.TOPK_IDS], ids[0]) and torch.equal(out[token_fields.STUDENT_LP], lp[0])


def test_teacher_phase_gathers_at_the_stored_ids_of_each_response_token():
    logits = torch.randn(1, sum(SEQ), V)
    ids_resp = torch.randint(0, V, (2, max(RESPONSES), K))
    out = _forward_only(MOPDLoss(), logits, _batch(token_fields.PHASE_TEACHER, _ids_fields(ids_resp)))
    assert sorted(out) == [token_fields.TEACHER_LP]
    q = out[token_fields.TEACHER_LP]  # [N, K]
    # response token (b, t) is predicted at packed position idx: Q there = log_softmax(z_idx)[ids[b, t]]
    rows = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    for pos, (b, t) in zip(_packed_idx().tolist(), rows):
        expect = torch.log_softmax(logits[0, pos], -1)[ids_resp[b, t]]
        torch.testing.assert_close(q[pos], expect, rtol=0, atol=1e-6)
    ref = teacher_logprobs_at(logits, torch.zeros(1, sum(SEQ), K, dtype=torch.long))
    torch.testing.assert_close(q[0], ref[0, 0], rtol=0, atol=1e-6)  # prompt positions use id 0 (ignored later)


def test_update_loss_equals_eq5_with_the_b7_micro_batch_weight_and_backpropagates_to_the_logits():
    logits = torch.randn(1, sum(SEQ), V, requires_grad=True)
    ids_resp = torch.randint(0, V, (2, max(RESPONSES), K))
    adv = torch.randn(2, max(RESPONSES), K)
    extra = _ids_fields(ids_resp)
    extra[token_fields.ADVANTAGES] = token_fields.pack_rows(adv, torch.tensor(RESPONSES))
    # this micro-batch (2 responses) is part of an update batch of 6 responses over 2 ranks (3 per rank): B.7 weight
    # n_resp(mb)/n_resp(rank) = 2/3; verl's global token count (batch_num_tokens) must not enter
    data = _batch(token_fields.PHASE_UPDATE, extra, dp_size=2, global_batch_size=6, batch_num_tokens=999)
    cfg = types.SimpleNamespace(global_batch_info={}, loss_scale_factor=None, loss_agg_mode="token-mean",
                                ppo_epochs=1)
    fn = MOPDLoss(actor_config=cfg)
    loss, metrics = _update_forward(fn, logits, data)
    # eq. (5) by hand: −(1/5) Σ_{5 response tokens} Σ_k A[b,t,k]·log_softmax(z_pos)[ids[b,t,k]], times 2/3 (B.7)
    total = 0.0
    rows = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    for pos, (b, t) in zip(_packed_idx().tolist(), rows):
        total = total - (adv[b, t] * torch.log_softmax(logits[0, pos], -1)[ids_resp[b, t]]).sum()
    expect = total / 5 * (2 / 3)
    torch.testing.assert_close(loss, expect, rtol=1e-6, atol=1e-7)
    loss.backward()
    assert logits.grad[0, [0, 1, 4, 5, 9]].abs().sum() == 0  # prompt positions and the final token get nothing
    assert logits.grad[0, _packed_idx()].abs().sum() > 0
    assert "mopd/tok_loss" in metrics


def test_non_update_phases_return_zero_loss_and_bad_phase_is_named():
    fn, data = MOPDLoss(), _batch(token_fields.PHASE_STUDENT_TOPK)
    fn(student_logits=torch.randn(1, sum(SEQ), V), data=data)
    loss, metrics = fn(model_output={}, data=data)
    assert float(loss) == 0.0 and metrics == {}
    with pytest.raises(ValueError, match="mopd_phase"):
        MOPDLoss()(model_output={}, data=_batch("grpo"))
    data = _batch(token_fields.PHASE_UPDATE, _ids_fields(torch.zeros(2, max(RESPONSES), K, dtype=torch.long)))
    with pytest.raises(ValueError, match="teacher loss"):
        _update_forward(MOPDLoss(), torch.randn(1, sum(SEQ), V), data)


def test_the_update_loss_refuses_a_micro_batch_without_its_own_processor_output():
    cfg = types.SimpleNamespace(global_batch_info={}, loss_scale_factor=None, loss_agg_mode="token-mean",
                                ppo_epochs=1)
    fn = MOPDLoss(actor_config=cfg)
    first = _batch(token_fields.PHASE_UPDATE, _ids_fields(torch.zeros(2, max(RESPONSES), K, dtype=torch.long)))
    second = _batch(token_fields.PHASE_UPDATE, _ids_fields(torch.zeros(2, max(RESPONSES), K, dtype=torch.long)))
    fn(student_logits=torch.randn(1, sum(SEQ), V), data=first)
    with pytest.raises(ValueError, match="no processor output of its own micro-batch"):
        fn(model_output={}, data=second)


def test_update_loss_refuses_other_aggregations_and_uneven_rank_splits():
    data = _batch(token_fields.PHASE_UPDATE, _ids_fields(torch.zeros(2, max(RESPONSES), K, dtype=torch.long)))
    cfg = types.SimpleNamespace(global_batch_info={}, loss_scale_factor=None, loss_agg_mode="seq-mean-token-mean",
                                ppo_epochs=1)
    fn = MOPDLoss(actor_config=cfg)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        _update_forward(fn, torch.randn(1, sum(SEQ), V), data)
    from claas_verl.mopd.trainer.loss import microbatch_weight

    assert microbatch_weight(2, 8, 2) == 0.5
    with pytest.raises(ValueError, match="split evenly"):
        microbatch_weight(2, 7, 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_shared_forward_token_loss_equals_the_update_loss_of_verls_pass(temperature):
    """``mopd.signal.passes: shared``: the token loss from a right-padded forward's logits (``response_logits`` then
    ``shared_token_loss``) is the update loss of verl's packed pass on the same logits, before the B.7 weight, with
    the same gradient; a subset of rows is that subset's own token mean."""
    from claas_verl.mopd.trainer.alignment import response_logits

    raw = torch.randn(1, sum(SEQ), V, dtype=torch.float64)
    ids_resp = torch.randint(0, V, (2, max(RESPONSES), K))
    adv = torch.randn(2, max(RESPONSES), K, dtype=torch.float64)
    extra = _ids_fields(ids_resp)
    extra[token_fields.ADVANTAGES] = token_fields.pack_rows(adv, torch.tensor(RESPONSES))
    data = _batch(token_fields.PHASE_UPDATE, extra, dp_size=1, global_batch_size=2)
    cfg = types.SimpleNamespace(global_batch_info={}, loss_scale_factor=None, loss_agg_mode="token-mean",
                                ppo_epochs=1)
    fn = MOPDLoss(actor_config=cfg)
    packed = (raw / temperature).requires_grad_(True)  # verl divides by the temperature before the processor
    ref, _ = _update_forward(fn, packed, data)  # weight n_resp(mb)/n_resp = 1
    ref.backward()

    padded = torch.zeros(2, max(SEQ), V, dtype=torch.float64)
    offsets = [0, SEQ[0]]
    for b, n in enumerate(SEQ):
        padded[b, :n] = raw[0, offsets[b]:offsets[b] + n]
    padded.requires_grad_(True)
    temps = torch.full((2,), temperature, dtype=torch.float64)
    rows = response_logits(padded, torch.tensor(SEQ), torch.tensor(RESPONSES), temps)
    loss, metrics = fn.shared_token_loss(rows, data, [0, 1])
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    loss.backward()
    for b, n in enumerate(SEQ):  # d/d(raw) through the division by the temperature
        torch.testing.assert_close(padded.grad[b, :n], packed.grad[0, offsets[b]:offsets[b] + n] / temperature,
                                   rtol=1e-10, atol=1e-12)
    assert padded.grad[0, SEQ[0]:].abs().sum() == 0  # padding gets nothing

    only, _ = fn.shared_token_loss(_row(padded.detach(), 1, temperature), data, [1])
    expect = 0.0
    for t in range(RESPONSES[1]):
        pos = SEQ[1] - RESPONSES[1] - 1 + t
        logp = torch.log_softmax(raw[0, SEQ[0] + pos] / temperature, -1)
        expect = expect - (adv[1, t] * logp[ids_resp[1, t]]).sum()
    torch.testing.assert_close(only, expect / RESPONSES[1], rtol=1e-6, atol=1e-9)  # the stored field is fp32


def _row(padded, b, temperature):
    from claas_verl.mopd.trainer.alignment import response_logits

    return response_logits(padded[b:b + 1], torch.tensor(SEQ[b:b + 1]), torch.tensor(RESPONSES[b:b + 1]),
                           torch.full((1,), temperature, dtype=torch.float64))
