"""The SDPO update loss on verl's packed layout equals ``sdpo_loss`` on full-vocabulary [B, T, V] tensors.

The worker stores only the student's top-K ids and the teacher's log-probs at those ids (one flattened-rows field
each);
the logits processor returns the student's full-vocabulary log-probs at the same ids. Since the K ids ARE the
student's top-K, sdpo_loss over those K columns (+ tail) must equal sdpo_loss over the whole vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from claas_verl.claas.trainer import sdpo_worker
from claas_verl.claas.trainer.tq_fields import HAS_FEEDBACK_FIELD
from claas_verl.losses.sdpo import sdpo_loss
from claas_verl.verl_ext.packed_batch import response_positions
from claas_verl.verl_ext.topk_fields import pack_rows

PROMPTS, RESPS, V, K = [3, 2], [2, 3], 7, 3


def _jag(rows):
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = [p + r for p, r in zip(PROMPTS, RESPS)]
    N = sum(seq)
    input_rows = [torch.randint(0, V, (n,), generator=g) for n in seq]
    logits = torch.randn(1, N, V, generator=g, requires_grad=True)
    teacher_full = torch.log_softmax(torch.randn(2, max(RESPS), V, generator=g), -1)
    behaviour = [torch.tensor([-3.0, 0.0]), torch.tensor([-4.5, 0.0, 0.0])]  # ℓb on the first position
    idx, rows, cols = response_positions(torch.tensor(seq), torch.tensor(RESPS))
    s_full = torch.zeros(2, max(RESPS), V)
    s_full[rows, cols] = torch.log_softmax(logits[0, idx].detach(), -1)
    ids = s_full.topk(K, dim=-1).indices
    t_at = teacher_full.gather(-1, ids)
    data = {
        "input_ids": _jag(input_rows),
        "response_mask": _jag([torch.ones(r, dtype=torch.long) for r in RESPS]),
        "old_log_probs": _jag(behaviour),
        HAS_FEEDBACK_FIELD: torch.tensor([1, 1]),
    }
    # what the worker's pre/teacher passes store: one flattened-rows field per quantity
    data[sdpo_worker.IDS] = pack_rows(ids, torch.tensor(RESPS))
    data[sdpo_worker.TEACHER_LP] = pack_rows(t_at, torch.tensor(RESPS))
    return seq, input_rows, logits, teacher_full, behaviour, data


def _model_output(loss, logits, data, input_rows, seq):
    """verl's engine under ``UPDATE_FLAGS`` (distillation_only): the processor form, then what it hands the loss
    form of the same micro-batch (the processor's one slot field; its log-probs go past verl, to the loss)."""
    cu = torch.tensor([0] + torch.tensor(seq).cumsum(0).tolist())
    return {k: torch.nested.nested_tensor_from_jagged(v.squeeze(0), cu)
            for k, v in loss(student_logits=logits, data=data).items()}


def test_packed_topk_loss_equals_full_vocabulary_sdpo_loss():
    seq, input_rows, logits, teacher_full, behaviour, data = _setup()
    cfg = dict(mode="gjs", alpha=0.5, topk=K, add_tail=True, is_clip=2.0, is_reference="behaviour",
               ratio_mode="geo_mean", tau=0.05, jsd_coef=1.0)
    loss_fn = sdpo_worker.ClaasSdpoLoss(cfg, actor_config=None)
    loss_fn.global_sd_tokens = float(sum(RESPS))
    loss, metrics = loss_fn(model_output=_model_output(loss_fn, logits, data, input_rows, seq), data=data)
    (g_ours,) = torch.autograd.grad(loss, logits)

    idx, rows, cols = response_positions(torch.tensor(seq), torch.tensor(RESPS))
    s_full = torch.zeros(2, max(RESPS), V).index_put((rows, cols), torch.log_softmax(logits[0, idx], -1))
    labels = torch.roll(torch.cat(input_rows), -1)
    log_prob = torch.zeros(2, max(RESPS)).index_put((rows, cols), s_full[rows, cols].gather(
        -1, labels[idx][:, None]).squeeze(-1))
    mask = torch.zeros(2, max(RESPS), dtype=torch.bool).index_put((rows, cols), torch.tensor(True))
    ref = torch.zeros(2, max(RESPS)).index_put((rows, cols), torch.cat(behaviour))
    expected, _ = sdpo_loss(s_full, teacher_full, log_prob, ref, mask, torch.tensor([1, 1]), topk=K,
                            is_clip=2.0, ratio_mode="geo_mean")
    (g_ref,) = torch.autograd.grad(expected, logits)
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    assert torch.allclose(g_ours, g_ref, atol=1e-6)
    assert "sdpo/loss" in metrics


def test_no_feedback_rows_give_zero_loss_and_gradient():
    seq, input_rows, logits, _, _, data = _setup(seed=1)
    data[HAS_FEEDBACK_FIELD] = torch.tensor([0, 0])
    cfg = dict(mode="gjs", alpha=0.5, topk=K, add_tail=True, is_clip=2.0, is_reference="behaviour",
               ratio_mode="geo_mean", tau=0.05, jsd_coef=1.0)
    loss_fn = sdpo_worker.ClaasSdpoLoss(cfg, actor_config=None)
    loss_fn.global_sd_tokens = 0.0  # the worker also skips the optimizer step in this case (docs/math.md §A.2.4)
    loss, _ = loss_fn(model_output=_model_output(loss_fn, logits, data, input_rows, seq), data=data)
    (g,) = torch.autograd.grad(loss, logits, allow_unused=True)
    assert float(loss) == 0.0 and (g is None or float(g.abs().max()) == 0.0)


def test_a_row_without_feedback_contributes_nothing_beside_one_with_feedback():
    """sd_mask per row: a chat turn without feedback text (row 1) gets no gradient, the row with text (row 0) does,
    and the loss equals the one over row 0 alone (the token mean over the sd tokens, docs/math.md §A.3.3)."""
    seq, input_rows, logits, teacher_full, behaviour, data = _setup(seed=3)
    data[HAS_FEEDBACK_FIELD] = torch.tensor([1, 0])
    cfg = dict(mode="gjs", alpha=0.5, topk=K, add_tail=True, is_clip=2.0, is_reference="behaviour",
               ratio_mode="geo_mean", tau=0.05, jsd_coef=1.0)
    loss_fn = sdpo_worker.ClaasSdpoLoss(cfg, actor_config=None)
    loss_fn.global_sd_tokens = float(RESPS[0])
    loss, _ = loss_fn(model_output=_model_output(loss_fn, logits, data, input_rows, seq), data=data)
    (g,) = torch.autograd.grad(loss, logits)
    assert float(loss.detach()) > 0
    assert float(g[0, : seq[0]].abs().max()) > 0 and float(g[0, seq[0]:].abs().max()) == 0.0

    idx, rows, cols = response_positions(torch.tensor(seq), torch.tensor(RESPS))
    s_full = torch.zeros(2, max(RESPS), V).index_put((rows, cols), torch.log_softmax(logits[0, idx], -1))
    labels = torch.roll(torch.cat(input_rows), -1)
    log_prob = torch.zeros(2, max(RESPS)).index_put((rows, cols), s_full[rows, cols].gather(
        -1, labels[idx][:, None]).squeeze(-1))
    mask = torch.zeros(2, max(RESPS), dtype=torch.bool).index_put((rows, cols), torch.tensor(True))
    ref = torch.zeros(2, max(RESPS)).index_put((rows, cols), torch.cat(behaviour))
    expected, _ = sdpo_loss(s_full[:1], teacher_full[:1], log_prob[:1], ref[:1], mask[:1], torch.tensor([1]),
                            topk=K, is_clip=2.0, ratio_mode="geo_mean")
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("mode,is_reference", [("pg+jsd", "behaviour"), ("gjs", "ema_teacher")])
def test_pg_jsd_and_teacher_is_reference_match_sdpo_loss(mode, is_reference):
    from types import SimpleNamespace

    seq, input_rows, logits, teacher_full, behaviour, data = _setup(seed=2)
    idx, rows, cols = response_positions(torch.tensor(seq), torch.tensor(RESPS))
    labels = torch.roll(torch.cat(input_rows), -1)
    y = torch.zeros(2, max(RESPS), dtype=torch.long).index_put((rows, cols), labels[idx])
    t_y = teacher_full.gather(-1, y[..., None]).squeeze(-1)
    data[sdpo_worker.TEACHER_LP_Y] = _jag([t_y[b, :r] for b, r in enumerate(RESPS)])
    data[sdpo_worker.IS_REF] = torch.tensor([-2.0, -5.0])  # EMA-teacher sequence log-probs of y on the student context
    cfg = dict(mode=mode, alpha=0.5, topk=K, add_tail=True, is_clip=2.0, is_reference=is_reference,
               ratio_mode="geo_mean", tau=0.05, jsd_coef=1.0)
    actor = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss_fn = sdpo_worker.ClaasSdpoLoss(cfg, actor_config=actor)
    loss_fn.global_sd_tokens = loss_fn.global_tokens = float(sum(RESPS))
    loss, _ = loss_fn(model_output=_model_output(loss_fn, logits, data, input_rows, seq), data=data)

    s_full = torch.zeros(2, max(RESPS), V).index_put((rows, cols), torch.log_softmax(logits[0, idx], -1))
    log_prob = s_full.gather(-1, y[..., None]).squeeze(-1)
    mask = torch.zeros(2, max(RESPS), dtype=torch.bool).index_put((rows, cols), torch.tensor(True))
    log_prob = log_prob * mask
    beh = torch.zeros(2, max(RESPS)).index_put((rows, cols), torch.cat(behaviour))
    ref = data[sdpo_worker.IS_REF] if is_reference == "ema_teacher" else beh
    expected, _ = sdpo_loss(s_full, teacher_full, log_prob, ref, mask, torch.tensor([1, 1]), mode=mode, topk=K,
                            is_clip=2.0, response_ids=y, old_log_prob=beh)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    g1, = torch.autograd.grad(loss, logits)
    g2, = torch.autograd.grad(expected, logits)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_chunked_response_logprob_stats_match_the_full_log_softmax():
    """The pre/teacher passes reduce on the device in position chunks; any chunk size gives the full-softmax values."""
    from types import SimpleNamespace

    from claas_verl.claas.trainer.sdpo_worker import response_logprob_stats

    torch.manual_seed(0)
    V = 50
    emb = torch.nn.Embedding(V, V)

    def module(input_ids, attention_mask, position_ids, use_cache):
        return SimpleNamespace(logits=emb(input_ids) * 3.0 + position_ids[..., None] * 0.01)

    seqs = [torch.randint(0, V, (9,)), torch.randint(0, V, (6,))]
    resp = [5, 3]
    at = [torch.randint(0, V, (r, 4)) for r in resp]
    with torch.no_grad():
        L = 9
        ids = torch.zeros((2, L), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = s
        full = torch.log_softmax(module(ids, None, torch.arange(L).expand(2, L), False).logits.float(), -1)
    for chunk in (1, 2, 512):
        stats = response_logprob_stats(module, seqs, resp, "cpu", topk=3, at_ids=at, at_tokens=True,
                                       chunk_tokens=chunk)
        for b, (s, r) in enumerate(zip(seqs, resp)):
            ref = full[b, len(s) - r - 1: len(s) - 1]
            assert torch.equal(stats[b]["topk"], ref.topk(3, -1).indices)
            torch.testing.assert_close(stats[b]["at_ids"], ref.gather(-1, at[b]))
            torch.testing.assert_close(stats[b]["at_tokens"], ref.gather(-1, s[len(s) - r:, None]).squeeze(-1))
