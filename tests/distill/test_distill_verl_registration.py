"""verl policy loss ``claas_topk_distill`` (docs/math.md §B.2.3 verl form) equals ``topk_distill_loss``."""

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn

import claas_verl.mopd.verl_losses  # noqa: F401  (registers the loss)
from claas_verl.distill import student_topk, topk_distill_loss, topk_logprobs


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, 20, generator=g)
    ids, _ = student_topk(logits, 5)
    A = torch.randn(3, 4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    return logits, ids, A, mask


def _config(**batch_info):
    return OmegaConf.create({"ppo_epochs": 1, "global_batch_info": batch_info})


def test_resolves_and_matches_topk_distill_loss():
    fn = get_policy_loss_fn("claas_topk_distill")
    logits, ids, A, mask = _batch()
    z1 = logits.clone().requires_grad_(True)
    z2 = logits.clone().requires_grad_(True)
    log_prob = topk_logprobs(z1, ids)
    loss, metrics = fn(
        old_log_prob=torch.zeros(3, 4),
        log_prob=log_prob,
        advantages=A,
        response_mask=mask.bool(),
        loss_agg_mode="token-mean",
        config=_config(),
        rollout_is_weights=None,
    )
    ref = topk_distill_loss(z2, ids, A, mask)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-6, atol=1e-9)
    assert "actor/topk_distill_adv_abs_mean" in metrics


def test_global_batch_info_is_used():
    # verl fills dp_size / batch_num_tokens: sum over this shard / 20 global tokens · 2 ranks
    fn = get_policy_loss_fn("claas_topk_distill")
    logits, ids, A, mask = _batch(1)
    log_prob = topk_logprobs(logits, ids)
    cfg = _config(dp_size=2, batch_num_tokens=20, global_batch_size=6, loss_scale_factor=None)
    loss, _ = fn(torch.zeros(3, 4), log_prob, A, mask, "token-mean", cfg, None)
    ref = topk_distill_loss(logits, ids, A, mask, global_tokens=20, dp_size=2)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    # and differs from the local token mean (7 valid tokens): ratio 7/20·2 = 0.7
    local = topk_distill_loss(logits, ids, A, mask)
    torch.testing.assert_close(loss, local * 0.7, rtol=1e-5, atol=0)


def test_rollout_is_weights_multiply_per_token_loss():
    fn = get_policy_loss_fn("claas_topk_distill")
    logits, ids, A, mask = _batch(2)
    log_prob = topk_logprobs(logits, ids)
    w = torch.full((3, 4), 0.5)
    loss_w, _ = fn(torch.zeros(3, 4), log_prob, A, mask, "token-mean", _config(), w)
    loss, _ = fn(torch.zeros(3, 4), log_prob, A, mask, "token-mean", _config(), None)
    torch.testing.assert_close(loss_w, 0.5 * loss)


def test_rejects_2d_tensors_and_multiple_epochs():
    fn = get_policy_loss_fn("claas_topk_distill")
    logits, ids, A, mask = _batch()
    with pytest.raises(ValueError, match="3-D"):
        fn(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4), mask, "token-mean", _config(), None)
    cfg = OmegaConf.create({"ppo_epochs": 2, "global_batch_info": {}})
    with pytest.raises(ValueError, match="ppo_epochs"):
        fn(torch.zeros(3, 4), topk_logprobs(logits, ids), A, mask, "token-mean", cfg, None)
