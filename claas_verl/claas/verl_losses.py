"""verl registrations of the CLaaS losses and advantages (docs/math.md §A.2, A.3); thin glue over ``claas_verl.losses``.

Registered names (after ``import claas_verl``, or in Ray workers via the ``verl.plugins`` entry point /
``VERL_USE_EXTERNAL_MODULES=claas_verl``):

- policy losses ``claas_seq_is`` (ratio_mode ``geo_mean``) and ``claas_seq_is_product`` (``product``),
  selected with ``actor_rollout_ref.actor.policy_loss.loss_mode=claas_seq_is``;
- advantage estimators ``claas_rpp_ema`` (REINFORCE++ with the EMA baseline) and
  ``claas_rpp_global_whiten`` (verl REINFORCE++ with the A.3.1 edge cases), selected with
  ``algorithm.adv_estimator=...``.

How a trainer supplies the EMA state to ``claas_rpp_ema``: verl calls an estimator with only
``token_level_rewards``, ``response_mask``, ``config`` and optional ``index``/``reward_baselines``, so
the running :class:`~claas_verl.losses.advantages.EmaRewardStats` cannot travel through the call. The
trainer (the process that owns the replay buffer and calls ``compute_advantage``, i.e. the driver)
binds its stats object once with :func:`bind_rpp_ema_stats`, keeps calling ``stats.update(r)`` at insertion
time, and saves ``stats.state_dict()`` in its checkpoints. The estimator only READS b and v; calling it with
nothing bound raises a ValueError that says so.

Host syncs: each policy loss makes exactly ONE per call, the single read of its metrics dict
(:func:`claas_verl.utils.host_sync.metrics_to_floats`). The math makes none (value checks only with
``CLAAS_VERL_DEBUG_CHECKS=1``), but verl 0.9.1's ``ppo_loss`` calls ``.item()`` on every tensor metric it is handed,
so tensors would cost seven syncs there. ``tests/losses/test_loss_host_syncs.py`` counts them.

PPO with a critic (docs/math.md §A.3.2, ``recipes/claas/ppo.yaml``) needs nothing registered here: verl's own ``gae``
estimator and critic worker compute the advantages and the value loss.
"""

from __future__ import annotations

from typing import Any

import torch

from claas_verl.losses.advantages import EmaRewardStats, global_whiten_advantages, sequence_rewards
from claas_verl.losses.seq_is import seq_is_clipped_loss
from claas_verl.utils.host_sync import metrics_to_floats
from claas_verl.verl_ext.registry import register_adv_est, register_policy_loss


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a verl ActorConfig / DictConfig / dict; None counts as missing."""
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def _seq_is_kwargs(config: Any, loss_agg_mode: str) -> dict:
    """Clip settings (clip_ratio[_low|_high|_c]) and verl's global_batch_info → our agg_loss kwargs."""
    if config is None:
        raise ValueError("claas_seq_is needs the actor config (clip_ratio, clip_ratio_low/high, clip_ratio_c)")
    eps = float(_cfg(config, "clip_ratio", 0.2))
    info = dict(_cfg(config, "global_batch_info", {}) or {})
    return dict(
        clip_ratio_low=float(_cfg(config, "clip_ratio_low", eps)),
        clip_ratio_high=float(_cfg(config, "clip_ratio_high", eps)),
        clip_ratio_c=float(_cfg(config, "clip_ratio_c", 3.0)),
        loss_agg_mode=loss_agg_mode,
        global_tokens=info.get("batch_num_tokens"),
        global_seqs=info.get("global_batch_size"),
        dp_size=int(info.get("dp_size") or 1),
        horizon=info.get("loss_scale_factor"),
    )


@register_policy_loss("claas_seq_is")
def compute_policy_loss_claas_seq_is(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl policy loss: docs/math.md §A.2 with ratio_mode ``geo_mean`` (see ``claas_verl.losses.seq_is_clipped_loss``).

    ``old_log_prob`` ``[B, T]``: only Σ_j m·old per sequence is used, so per-token behaviour log-probs
    or ℓb placed on one valid position both work. ``rollout_is_weights`` multiplies the token loss.
    Metrics: Python floats, read in one host transfer (the module's one sync per call).
    """
    loss, metrics = seq_is_clipped_loss(
        log_prob, old_log_prob, advantages, response_mask, ratio_mode="geo_mean",
        token_weights=rollout_is_weights, **_seq_is_kwargs(config, loss_agg_mode),
    )
    return loss, metrics_to_floats(metrics)


@register_policy_loss("claas_seq_is_product")
def compute_policy_loss_claas_seq_is_product(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl policy loss: docs/math.md §A.2 with ratio_mode ``product`` (the literal trajectory ratio π_θ(y)/π_β(y)).

    Metrics as in :func:`compute_policy_loss_claas_seq_is` (floats, one host transfer).
    """
    loss, metrics = seq_is_clipped_loss(
        log_prob, old_log_prob, advantages, response_mask, ratio_mode="product",
        token_weights=rollout_is_weights, **_seq_is_kwargs(config, loss_agg_mode),
    )
    return loss, metrics_to_floats(metrics)


# --------------------------------------------------------------------------- REINFORCE++ estimators

_BOUND_EMA_STATS: EmaRewardStats | None = None


def bind_rpp_ema_stats(stats: EmaRewardStats | None) -> None:
    """Make ``stats`` the running state read by the ``claas_rpp_ema`` estimator in this process (None unbinds)."""
    global _BOUND_EMA_STATS
    if stats is not None and not isinstance(stats, EmaRewardStats):
        raise ValueError(f"bind_rpp_ema_stats expects an EmaRewardStats, got {type(stats).__name__}")
    _BOUND_EMA_STATS = stats


_ON_POLICY_STATS: EmaRewardStats | None = None
_ON_POLICY_KEYS = ("beta", "b0", "v0", "v_min")


def _on_policy_stats(config: Any) -> EmaRewardStats | None:
    """The process's on-policy EMA state when ``algorithm.claas_rpp_ema`` is in the config (verl's own trainers).

    ``+algorithm.claas_rpp_ema={}`` (or with any of beta, b0, v0, v_min) selects it from the command line;
    it is created on the first call and lives as long as the trainer process (a resumed run starts again
    from b0, v0: verl's trainer does not checkpoint it).
    """
    global _ON_POLICY_STATS
    node = _cfg(config, "claas_rpp_ema")
    if node is None:
        return None
    if _ON_POLICY_STATS is None:
        items = dict(node.items()) if hasattr(node, "items") else {}
        unknown = sorted(set(items) - set(_ON_POLICY_KEYS))
        if unknown or not hasattr(node, "items"):
            raise ValueError(
                f"algorithm.claas_rpp_ema: unknown keys {unknown or [node]}; allowed: {list(_ON_POLICY_KEYS)}"
            )
        _ON_POLICY_STATS = EmaRewardStats(**{k: float(v) for k, v in items.items() if v is not None})
    return _ON_POLICY_STATS


@register_adv_est("claas_rpp_ema")
def compute_claas_rpp_ema_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator, docs/math.md §A.3.1 ``ema`` mode: A = m·(r − b)/sqrt(max(v, v_min)).

    r_e = Σ_j m·R[e,j] (verl puts the scalar reward on the last valid token). b, v come from the
    :class:`EmaRewardStats` bound with :func:`bind_rpp_ema_stats`; they are read, never updated, here.
    Without a bound state, ``algorithm.claas_rpp_ema`` in the config selects the on-policy state of
    :func:`_on_policy_stats` (verl's own ``main_ppo``): there the batch is inserted and drawn at once, so
    its rewards are folded in first (A.3.1 "at insertion time") and b, v are read after.
    Returns ``(advantages, returns)`` with returns = r_e·m.
    """
    r = sequence_rewards(token_level_rewards, response_mask)
    stats = _BOUND_EMA_STATS
    if stats is None:
        stats = _on_policy_stats(config)
        if stats is None:
            raise ValueError(
                "adv_estimator 'claas_rpp_ema' has no running reward statistics in this process: call "
                "claas_verl.claas.verl_losses.bind_rpp_ema_stats(stats) in the trainer that computes advantages, "
                "or, in verl's own trainer, add +algorithm.claas_rpp_ema={} (on-policy EMA; keys beta, b0, v0, v_min)"
            )
        stats.update_many(r.tolist())
    adv = stats.advantages(r, response_mask)
    return adv, r.unsqueeze(-1) * response_mask.float()


@register_adv_est("claas_rpp_global_whiten")
def compute_claas_rpp_global_whiten_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator, docs/math.md §A.3.1 ``global_whiten`` mode (γ from ``config.gamma``, default 1).

    Same as verl's ``reinforce_plus_plus`` except that Σm ≤ 1 or all-equal returns give A = 0 instead of
    raising / a tiny residue.
    """
    gamma = float(_cfg(config, "gamma", 1.0))
    return global_whiten_advantages(token_level_rewards, response_mask, gamma)
