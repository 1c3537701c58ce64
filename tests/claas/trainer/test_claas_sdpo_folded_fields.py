"""The SDPO worker's pre/teacher passes store ONE flattened-rows field per K-wide quantity, and the update loss
read from them (also after verl's micro-batch split) equals ``sdpo_loss`` on the dense ``[B, T, K]`` tensors.

``ClaasSdpoTrainingWorker._add_teacher_fields`` runs for real on a per-token toy model (no attention, so its padded
and packed forwards agree exactly) whose LoRA-named table the EMA teacher swaps.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from claas_verl.claas.trainer import sdpo_worker
from claas_verl.claas.trainer.tq_fields import HAS_FEEDBACK_FIELD, TEACHER_PROMPT_FIELD
from claas_verl.losses.sdpo import EmaTeacher, sdpo_loss
from claas_verl.verl_ext.packed_batch import response_positions
from claas_verl.verl_ext.topk_fields import unpack_rows

V = 9
PROMPTS, RESPS, TEACHER_PROMPTS = [3, 2, 4], [2, 4, 3], [5, 1, 2]
SEQ = [p + r for p, r in zip(PROMPTS, RESPS)]
CFG = dict(mode="gjs", alpha=0.5, add_tail=True, is_clip=2.0, is_reference="behaviour", ratio_mode="geo_mean",
           tau=0.05, jsd_coef=1.0)


class _Toy(torch.nn.Module):
    """logits(token, position) = table[token] + lora_B[token] + 0.01·position: per token, so packing is exact."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=g) * 2)
        self.lora_B = torch.nn.Parameter(torch.randn(V, V, generator=g) * 0.1)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        pos = position_ids if position_ids is not None else torch.arange(input_ids.shape[-1]).expand_as(input_ids)
        return SimpleNamespace(logits=self.table[input_ids] + self.lora_B[input_ids] + 0.01 * pos[..., None])


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def _batch(resps=tuple(RESPS), dense_mask: bool = False) -> TensorDict:
    g = torch.Generator().manual_seed(1)
    mask = [torch.ones(r, dtype=torch.long) for r in resps]
    return TensorDict({
        "input_ids": _nested(torch.randint(0, V, (p + r,), generator=g) for p, r in zip(PROMPTS, resps)),
        "response_mask": torch.stack(mask) if dense_mask else _nested(mask),
        TEACHER_PROMPT_FIELD: _nested(torch.randint(0, V, (n,), generator=g) for n in TEACHER_PROMPTS),
        HAS_FEEDBACK_FIELD: torch.tensor([1, 0, 1]),
        "old_log_probs": _nested(torch.full((r,), -0.5) for r in resps),
    }, batch_size=[len(resps)])


def _worker(k: int):
    toy = _Toy()
    worker = sdpo_worker.ClaasSdpoTrainingWorker.__new__(sdpo_worker.ClaasSdpoTrainingWorker)
    worker.sdpo = dict(CFG, topk=k)
    worker.engine = SimpleNamespace(module=toy, eval_mode=contextlib.nullcontext)
    worker.engine_config = SimpleNamespace(micro_batch_size_per_gpu=2)
    worker.ema = EmaTeacher(toy, tau=0.05, scope="lora")
    worker.ema.params["lora_B"] += torch.randn(V, V, generator=torch.Generator().manual_seed(2))  # θ_T ≠ θ
    worker.loss_fn_sdpo = sdpo_worker.ClaasSdpoLoss(worker.sdpo, actor_config=None)
    return worker, toy


def _packed_logits(toy, data):
    rows = list(data["input_ids"].unbind())
    return torch.cat([toy(r[None], position_ids=torch.arange(len(r))[None]).logits[0] for r in rows])[None]


def _loss_through_the_two_call_forms(loss_fn, logits, data):
    out = loss_fn(student_logits=logits, data=data)
    cu = data["input_ids"].offsets()
    model_output = {n: torch.nested.nested_tensor_from_jagged(v[0], cu) for n, v in out.items()}
    return loss_fn(model_output=model_output, data=data)[0]


def _dense_reference(toy, teacher, data, logits, k):
    """s_k, t_k, log π(y), ℓb and the mask as dense [B, T(, K)] tensors, straight from the two models."""
    seq, resp = torch.tensor(SEQ), torch.tensor(RESPS)
    idx, rows, cols = response_positions(seq, resp)
    B, T = len(SEQ), max(RESPS)
    s_lp = torch.log_softmax(logits[0, idx], -1)  # [M, V] with grad
    ids = s_lp.detach().topk(k, -1).indices
    y = torch.roll(data["input_ids"].values(), -1)[idx]
    t_logits = []
    for b, (p, r) in enumerate(zip(data[TEACHER_PROMPT_FIELD].unbind(), RESPS)):
        s = torch.cat([p, data["input_ids"].unbind()[b][-r:]])
        t_logits.append(teacher(s[None], position_ids=torch.arange(len(s))[None]).logits[0, len(s) - r - 1:-1])
    t_lp = torch.log_softmax(torch.cat(t_logits), -1).detach()

    def dense(x, *tail):
        return torch.zeros(B, T, *tail, dtype=x.dtype).index_put((rows, cols), x)

    s_k, t_k = dense(s_lp.gather(-1, ids), k), dense(t_lp.gather(-1, ids), k)
    log_prob = dense(s_lp.gather(-1, y[:, None])[:, 0])
    mask = dense(torch.ones(len(idx), dtype=torch.bool))
    return s_k, t_k, log_prob, dense(torch.full((len(idx),), -0.5)), mask, ids


@pytest.mark.parametrize("k", [1, 3, V])
def test_one_field_per_quantity_whatever_k_and_the_loss_equals_sdpo_loss_on_dense_tensors(k):
    worker, toy = _worker(k)
    data = _batch()
    before = set(data.keys())
    n_sd, n_tok = worker._add_teacher_fields(data)
    # 3 fields for any K
    assert set(data.keys()) - before == {sdpo_worker.IDS, sdpo_worker.TEACHER_LP, sdpo_worker.TEACHER_LP_Y}
    assert (n_sd, n_tok) == (RESPS[0] + RESPS[2], sum(RESPS))
    for name in (sdpo_worker.IDS, sdpo_worker.TEACHER_LP):
        assert data[name].is_nested and data[name].offsets().diff().tolist() == [r * k for r in RESPS]

    logits = _packed_logits(toy, data).detach().requires_grad_(True)
    teacher = _Toy()
    teacher.load_state_dict({"table": toy.table.detach(), "lora_B": worker.ema.params["lora_B"]})
    s_k, t_k, log_prob, ref, mask, ids = _dense_reference(toy, teacher, data, logits, k)
    stored = unpack_rows(data[sdpo_worker.IDS], k)
    assert torch.equal(stored[mask], ids)  # the pre-pass stored the student's top-K ids of each response token
    torch.testing.assert_close(unpack_rows(data[sdpo_worker.TEACHER_LP], k)[mask], t_k[mask])

    loss_fn = worker.loss_fn_sdpo
    loss_fn.global_sd_tokens = n_sd
    loss = _loss_through_the_two_call_forms(loss_fn, logits, data)
    sd = data[HAS_FEEDBACK_FIELD].bool()
    expected, _ = sdpo_loss(s_k, t_k, log_prob, ref, mask, sd, mode="gjs", alpha=0.5, topk=k, add_tail=True,
                            is_clip=2.0, ratio_mode="geo_mean", global_sd_tokens=n_sd)
    assert float(expected.detach()) > 0
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    g_ours, = torch.autograd.grad(loss, logits)
    g_ref, = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)

    # verl's micro-batch split (tu.chunk_tensordict) keeps each row's flattened values: the per-micro-batch losses
    # (token sums over the global SD-token count) add up to the whole batch's
    parts = tu.chunk_tensordict(data, 3)
    total = sum(_loss_through_the_two_call_forms(loss_fn, _packed_logits(toy, mb), mb) for mb in parts)
    torch.testing.assert_close(total.detach(), loss.detach(), rtol=1e-5, atol=1e-7)


def test_a_dense_response_mask_gives_the_same_folded_fields_and_loss():
    """verl's no-padding batches carry a nested response_mask; a dense [B, T] one (every response T long) folds
    the same way and trains to the same loss."""
    losses, fields = [], []
    for dense in (False, True):
        worker, toy = _worker(3)
        data = _batch(resps=(3, 3, 3), dense_mask=dense)
        n_sd, _ = worker._add_teacher_fields(data)
        worker.loss_fn_sdpo.global_sd_tokens = n_sd
        fields.append((data[sdpo_worker.IDS].values(), data[sdpo_worker.TEACHER_LP].values()))
        assert data[sdpo_worker.TEACHER_LP_Y].is_nested != dense  # follows the mask's layout
        losses.append(_loss_through_the_two_call_forms(worker.loss_fn_sdpo, _packed_logits(toy, data), data))
    assert all(torch.equal(a, b) for a, b in zip(*fields))
    assert float(losses[0].detach()) > 0
    torch.testing.assert_close(losses[0], losses[1])


def test_a_padded_batch_is_refused_naming_the_fix():
    worker, _ = _worker(3)
    data = _batch()
    data["input_ids"] = data["input_ids"].to_padded_tensor(0)
    with pytest.raises(ValueError, match="no-padding batch layout"):
        worker._add_teacher_fields(data)
