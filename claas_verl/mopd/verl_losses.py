"""verl policy loss ``claas_topk_distill``: the MOPD token channel (docs/math.md §B.2.3 "verl form", MOPD paper eq. 5).

Select it with ``actor_rollout_ref.actor.policy_loss.loss_mode=claas_topk_distill`` (and ``ppo_epochs=1``).

What a verl pipeline must carry (a stock verl actor does NOT produce these; the actor/trainer override does):

===================  =================  =====================================================================
tensor               shape / dtype      produced by
===================  =================  =====================================================================
``topk_ids``         [B, T_r, K] int64  :func:`claas_verl.distill.student_topk` on the training model's logits
                                        *before* the update (docs/math.md §B.2.1), stored in the batch.
``teacher topk lp``  [B, T_r, K] fp32   :func:`claas_verl.distill.teacher_logprobs_at` on the step's teacher
                                        (full-vocabulary, not renormalised); used only to build advantages.
``advantages``       [B, T_r, K] fp32   :func:`claas_verl.distill.topk_rewards` then
                                        :func:`claas_verl.distill.domain_normalized_advantages` with the
                                        per-response domain ids (all-reduced across DP ranks). Replaces verl's
                                        2-D ``advantages``; no advantage estimator runs.
``log_prob``         [B, T_r, K] fp32   the actor's differentiable forward: full-vocabulary
                                        ``log_softmax(logits/τ)`` gathered at ``topk_ids`` — use
                                        :func:`claas_verl.distill.topk_logprobs` (chunked, checkpointed) instead
                                        of verl's ``logprobs_from_logits`` at the sampled token.
``response_mask``    [B, T_r]           as usual (docs/math.md §0).
``old_log_prob``     any                unused: with ppo_epochs = 1 the ratio is 1 (docs/math.md §B.1), and this loss
                                        has no ratio or clipping.
===================  =================  =====================================================================

``config.global_batch_info`` (verl fills ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``) is mapped onto :func:`claas_verl.utils.masked.agg_loss`, so the token mean is over the
valid positions of the whole global batch, invariant to sharding.

Host syncs: ONE per call, the read of its metric (:func:`claas_verl.utils.host_sync.metrics_to_floats`; verl's
``Metric`` would ``.item()`` a tensor anyway). The loss math makes none; ``tests/losses/test_loss_host_syncs.py``
counts them.
"""

from __future__ import annotations

from typing import Any

import torch

from claas_verl.distill.topk import topk_distill_loss_from_logprobs
from claas_verl.utils.host_sync import metrics_to_floats
from claas_verl.verl_ext.registry import register_policy_loss


def _cfg_get(config, key: str, default=None):
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


@register_policy_loss("claas_topk_distill")
def compute_policy_loss_claas_topk_distill(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``pg_losses[b,t] = Σ_k −A[b,t,k]·log_prob[b,t,k]``, then agg_loss (docs/math.md §B.2.3 verl form).

    Args:
        old_log_prob: ignored (ppo_epochs must be 1; see the module docstring).
        log_prob: ``[B, T, K]`` differentiable log π_θ at the stored top-k ids.
        advantages: ``[B, T, K]`` per-domain normalised advantages.
        response_mask: ``[B, T]``.
        loss_agg_mode: verl's aggregation mode (MOPD paper: ``token-mean``).
        config: verl ActorConfig; ``global_batch_info`` and ``ppo_epochs`` are read.
        rollout_is_weights: optional ``[B, T]`` per-token weights multiplying ``pg_losses`` (verl convention).

    Returns:
        ``(loss, {"actor/topk_distill_adv_abs_mean": float})``: the token mean of ``Σ_k |A|`` over valid positions,
        read in one host transfer.
    """
    if log_prob.dim() != 3 or advantages.dim() != 3:
        raise ValueError(
            "claas_topk_distill needs 3-D log_prob and advantages [B, T, K] (log π at the stored student top-k ids "
            f"and their advantages); got log_prob {tuple(log_prob.shape)}, advantages {tuple(advantages.shape)}. "
            "The actor must gather log-probs at topk_ids (claas_verl.distill.topk_logprobs)."
        )
    epochs = _cfg_get(config, "ppo_epochs", 1)
    if epochs is not None and int(epochs) != 1:
        raise ValueError(
            "claas_topk_distill assumes ppo_epochs=1 (docs/math.md §B.1: one update per step, ratio = 1); "
            f"got ppo_epochs={epochs}"
        )
    info = dict(_cfg_get(config, "global_batch_info", None) or {})
    loss_kwargs = {
        "global_tokens": info.get("batch_num_tokens"),
        "global_seqs": info.get("global_batch_size"),
        "dp_size": int(info.get("dp_size") or 1),
        "horizon": info.get("loss_scale_factor"),
    }
    if rollout_is_weights is None:
        loss = topk_distill_loss_from_logprobs(
            log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode, **loss_kwargs
        )
    else:
        if rollout_is_weights.shape != response_mask.shape:
            raise ValueError(
                f"rollout_is_weights must be [B, T] like response_mask {tuple(response_mask.shape)}; "
                f"got {tuple(rollout_is_weights.shape)}"
            )
        # a per-token weight multiplies Σ_k(−A·logp), i.e. every candidate's advantage at that token
        weighted_adv = advantages.detach().float() * rollout_is_weights.detach().float().unsqueeze(-1)
        loss = topk_distill_loss_from_logprobs(
            log_prob, weighted_adv, response_mask, loss_agg_mode=loss_agg_mode, **loss_kwargs
        )
    with torch.no_grad():
        valid = response_mask.bool()
        n = valid.sum().clamp(min=1)
        adv_abs = (advantages.detach().float().abs().sum(-1) * valid).sum() / n
    return loss, metrics_to_floats({"actor/topk_distill_adv_abs_mean": adv_abs})
