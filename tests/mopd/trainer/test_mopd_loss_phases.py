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
from claas_verl.mopd.trainer import fields as F
from claas_verl.mopd.trainer.loss import MOPDLoss

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
    tu.assign_non_tensor(td, **{F.PHASE_KEY: phase, F.TOPK_KEY: K, "dp_size": 1, "batch_num_tokens": sum(RESPONSES),
                                 "global_batch_size": 2, **non_tensor})
    return td


def _ids_fields(ids_resp):
    # response-layout ids [B, T_r, K] -> one flattened-rows field, as the trainer stores them
    return {F.TOPK_IDS: F.pack_rows(ids_resp, torch.tensor(RESPONSES))}


def _packed_idx():
    idx, _, _ = F.response_positions(torch.tensor(SEQ), torch.tensor(RESPONSES))
    return idx  # packed positions predicting response tokens: [2, 3, 6, 7, 8]


def test_student_phase_returns_topk_per_packed_token():
    logits = torch.randn(1, sum(SEQ), V)
    out = MOPDLoss()(student_logits=logits, data=_batch(F.PHASE_STUDENT_TOPK))
    ids, lp = student_topk(logits, K)
    assert sorted(out) == sorted(F.names(F.STUDENT_IDS_PACKED, K) + F.names(F.STUDENT_LP_PACKED, K))
    for j in range(K):
        assert out[f"{F.STUDENT_IDS_PACKED}{j}"].shape == (1, sum(SEQ))  # verl asserts one value per token
        assert torch.equal(out[f"{F.STUDENT_IDS_PACKED}{j}"], ids[..., j])
        assert torch.equal(out[f"{F.STUDENT_LP_PACKED}{j}"], lp[..., j])


def test_teacher_phase_gathers_at_the_stored_ids_of_each_response_token():
    logits = torch.randn(1, sum(SEQ), V)
    ids_resp = torch.randint(0, V, (2, max(RESPONSES), K))
    out = MOPDLoss()(student_logits=logits, data=_batch(F.PHASE_TEACHER, _ids_fields(ids_resp)))
    q = torch.stack([out[f"{F.TEACHER_LP_PACKED}{j}"][0] for j in range(K)], -1)  # [N, K]
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
    extra[F.ADVANTAGES] = F.pack_rows(adv, torch.tensor(RESPONSES))
    # this micro-batch (2 responses) is part of an update batch of 6 responses over 2 ranks (3 per rank): B.7 weight
    # n_resp(mb)/n_resp(rank) = 2/3; verl's global token count (batch_num_tokens) must not enter
    data = _batch(F.PHASE_UPDATE, extra, dp_size=2, global_batch_size=6, batch_num_tokens=999)
    cfg = types.SimpleNamespace(global_batch_info={}, loss_scale_factor=None, loss_agg_mode="token-mean",
                                ppo_epochs=1)
    fn = MOPDLoss(actor_config=cfg)
    packed = fn(student_logits=logits, data=data)
    cu = data["input_ids"].offsets()
    model_output = {k: torch.nested.nested_tensor_from_jagged(v[0], cu) for k, v in packed.items()}
    loss, metrics = fn(model_output=model_output, data=data)
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
    loss, metrics = MOPDLoss()(model_output={}, data=_batch(F.PHASE_TEACHER))
    assert float(loss) == 0.0 and metrics == {}
    with pytest.raises(ValueError, match="mopd_phase"):
        MOPDLoss()(model_output={}, data=_batch("grpo"))
    with pytest.raises(ValueError, match="teacher loss"):
        MOPDLoss()(model_output={}, data=_batch(F.PHASE_UPDATE))


def test_update_loss_refuses_other_aggregations_and_uneven_rank_splits():
    data = _batch(F.PHASE_UPDATE, _ids_fields(torch.zeros(2, max(RESPONSES), K, dtype=torch.long)))
    cfg = types.SimpleNamespace(global_batch_info={}, loss_scale_factor=None, loss_agg_mode="seq-mean-token-mean",
                                ppo_epochs=1)
    fn = MOPDLoss(actor_config=cfg)
    packed = fn(student_logits=torch.randn(1, sum(SEQ), V), data=data)
    cu = data["input_ids"].offsets()
    model_output = {k: torch.nested.nested_tensor_from_jagged(v[0], cu) for k, v in packed.items()}
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(model_output=model_output, data=data)
    from claas_verl.mopd.trainer.loss import microbatch_weight

    assert microbatch_weight(2, 8, 2) == 0.5
    with pytest.raises(ValueError, match="split evenly"):
        microbatch_weight(2, 7, 2)
