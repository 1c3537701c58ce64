"""SDPO ``pg+jsd`` through verl's own output processing, with flash-attn's in-place cross-entropy.

On GPU machines with flash-attn, verl's ``FSDPEngineWithLMHead.prepare_model_outputs`` takes the sampled-token
log-probs from flash-attn's Triton ``cross_entropy_loss(..., inplace_backward=True)``, whose backward writes the
logits' gradient into the logits tensor itself: the same tensor the SDPO logits processor
(:func:`claas_verl.distill.topk_logprobs`) reads again in ITS backward. flash-attn needs CUDA, so a stand-in with
the same contract (returns ``(losses, z_losses)``; backward overwrites the logits' storage by a raw write that
autograd's version counter does not see, like the Triton kernel) is installed where verl looks it up. The
gradient of the SDPO loss through verl's real code must equal plain autograd on a full-vocabulary reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import verl.utils.torch_functional as verl_F
from test_claas_sdpo_worker_loss import RESPS, K, V, _setup
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from claas_verl.claas.trainer import sdpo_worker
from claas_verl.losses.sdpo import sdpo_loss
from claas_verl.verl_ext.packed_batch import response_positions


class _InplaceBackwardCrossEntropy(torch.autograd.Function):
    """``-log_softmax(logits)[labels]`` whose backward overwrites ``logits`` with the gradient (flash-attn's
    ``inplace_backward=True``)."""

    @staticmethod
    def forward(ctx, logits, labels):
        lse = torch.logsumexp(logits.float(), -1)
        ctx.save_for_backward(logits, labels, lse)
        losses = lse - logits.float().gather(-1, labels[:, None]).squeeze(-1)
        return losses, torch.zeros_like(losses)

    @staticmethod
    def backward(ctx, grad_losses, _grad_z):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.exp(logits.float() - lse[:, None])
        grad[torch.arange(labels.shape[0]), labels] -= 1.0
        logits.data.copy_(grad * grad_losses[:, None])  # a raw write into the logits' storage, no version bump
        return logits, None


def _flash_cross_entropy(logits, labels, inplace_backward=False):
    assert inplace_backward, "verl's FSDP engine asks for the in-place backward when it needs no entropy"
    return _InplaceBackwardCrossEntropy.apply(logits, labels)


def test_pg_jsd_gradient_is_exact_with_verls_inplace_flash_cross_entropy(monkeypatch):
    monkeypatch.setattr(verl_F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", True)
    monkeypatch.setattr(verl_F, "cross_entropy_loss", _flash_cross_entropy, raising=False)
    monkeypatch.delenv("VERL_DISABLE_FLASH_ATTN_CE", raising=False)
    seq, input_rows, leaf, teacher_full, behaviour, data = _setup(seed=3)
    idx, rows, cols = response_positions(torch.tensor(seq), torch.tensor(RESPS))
    labels = torch.roll(torch.cat(input_rows), -1)  # verl's input_ids_rmpad_rolled
    y = torch.zeros(2, max(RESPS), dtype=torch.long).index_put((rows, cols), labels[idx])
    data[sdpo_worker.TEACHER_LP_Y] = torch.nested.nested_tensor(
        [teacher_full.gather(-1, y[..., None])[b, :r, 0] for b, r in enumerate(RESPS)], layout=torch.jagged)
    micro_batch = tu.get_tensordict(data, non_tensor_dict={"use_remove_padding": True, **sdpo_worker.UPDATE_FLAGS})
    cfg = dict(mode="pg+jsd", alpha=0.5, topk=K, add_tail=True, is_clip=2.0, is_reference="behaviour",
               ratio_mode="geo_mean", tau=0.05, jsd_coef=1.0)
    actor_config = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss_fn = sdpo_worker.ClaasSdpoLoss(cfg, actor_config=actor_config)
    loss_fn.global_sd_tokens = loss_fn.global_tokens = float(sum(RESPS))

    # verl's packed path (use_remove_padding), engine state it reads on that path only
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.use_ulysses_sp = False
    logits = leaf * 1.0  # the model's output: the leaf's own values stay intact whatever is written into this
    output_args = {"input_ids_rmpad_rolled": labels, "temperature_rmpad": torch.ones(sum(seq)), "pad_size": 0,
                   "temperature_is_one": True}
    model_output = engine.prepare_model_outputs(SimpleNamespace(logits=logits), output_args, micro_batch, loss_fn)
    loss, _ = loss_fn(model_output=model_output, data=micro_batch)
    (grad,) = torch.autograd.grad(loss, leaf)

    s_full = torch.zeros(2, max(RESPS), V).index_put((rows, cols), torch.log_softmax(leaf[0, idx], -1))
    mask = torch.zeros(2, max(RESPS), dtype=torch.bool).index_put((rows, cols), torch.tensor(True))
    log_prob = s_full.gather(-1, y[..., None]).squeeze(-1) * mask
    beh = torch.zeros(2, max(RESPS)).index_put((rows, cols), torch.cat(behaviour))
    expected, _ = sdpo_loss(s_full, teacher_full, log_prob, beh, mask, torch.tensor([1, 1]), mode="pg+jsd", topk=K,
                            is_clip=2.0, response_ids=y, old_log_prob=beh)
    (grad_ref,) = torch.autograd.grad(expected, leaf)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-7)
