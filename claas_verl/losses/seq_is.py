"""Sequence-level importance-sampled clipped policy-gradient loss (docs/math.md §A.2), torch only.

CLaaS replays a response for several updates after it was generated, and the
buffer keeps only ONE behaviour log-prob per response (docs/math.md §A.1.1), so the
per-token PPO ratio is impossible. This module builds the sequence ratio
(``geo_mean``: GSPO's length-normalised s_i(θ); ``product``: the literal
trajectory ratio π_θ(y)/π_β(y)) and spreads it over tokens with the GSPO-token
trick, whose value is the sequence ratio and whose gradient is ρ·∇log π.

No host sync per call: the checks that read values (NaN/inf at valid positions) run only with the debug flag
``CLAAS_VERL_DEBUG_CHECKS=1`` (:mod:`claas_verl.utils.host_sync`), and the metrics are 0-dim tensors.

No verl import here; the verl registration lives in ``claas_verl.claas.verl_losses``.
"""

from __future__ import annotations

import math

import torch

from claas_verl.utils.host_sync import check_finite
from claas_verl.utils.masked import LOSS_AGG_MODES, agg_loss, masked_mean, masked_sum

RATIO_MODES = ("geo_mean", "product")

# verl vanilla clamps the log-ratio to ±20 before exp (docs/math.md §A.2.2, product mode).
PRODUCT_LOG_RATIO_CLAMP = 20.0
# verl GSPO clamps the per-token log-ratio at 10 (docs/math.md §A.2.2, geo_mean mode).
GEO_MEAN_TOKEN_LOG_RATIO_MAX = 10.0


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor has the same shape (host metadata only: no sync)."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch, all of these must be [B, T]: {shapes}")


def behaviour_seq_logprob(old_log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """ℓb[e] = Σ_j m[e,j]·old[e,j] (docs/math.md §A.2.1), fp32, shape ``[B]``.

    Only this masked per-sequence SUM of ``old_log_prob`` ever enters the ratio. A caller may
    therefore pass per-token behaviour log-probs ``[B, T]``, or a per-sequence value ℓb placed on
    ONE valid position of each row (zeros elsewhere), or a ``[B]`` tensor of ℓb directly.
    """
    if old_log_prob.dim() == 1:
        check_finite("old_log_prob", old_log_prob, response_mask.bool().any(dim=-1))
        valid_row = response_mask.bool().any(dim=-1)
        return torch.where(valid_row, old_log_prob.float(), torch.zeros_like(old_log_prob, dtype=torch.float32))
    check_same_shape(old_log_prob=old_log_prob, response_mask=response_mask)
    check_finite("old_log_prob", old_log_prob, response_mask)
    return masked_sum(old_log_prob.float(), response_mask, dim=-1)


def sequence_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    ratio_mode: str = "geo_mean",
) -> torch.Tensor:
    """Per-sequence log-ratio logρ[e] of docs/math.md §A.2.2, shape ``[B]`` (keeps the graph of ``log_prob``).

    Δ[e] = Σ_j m·logp − ℓb[e];  product: logρ = clamp(Δ, −20, 20);  geo_mean: logρ = Δ / max(n, 1).

    Args:
        log_prob: ``[B, T]`` current log π_θ of the sampled tokens.
        old_log_prob: ``[B, T]`` (or ``[B]``) behaviour log-probs; see :func:`behaviour_seq_logprob`.
        response_mask: ``[B, T]``; rows with n=0 get logρ=0 (ratio 1) and never reach the loss.
        ratio_mode: ``"geo_mean"`` (default) or ``"product"``.
    """
    if ratio_mode not in RATIO_MODES:
        raise ValueError(f"ratio_mode={ratio_mode!r} is not supported; choose one of {RATIO_MODES}")
    lb = behaviour_seq_logprob(old_log_prob, response_mask)
    delta = masked_sum(log_prob.float(), response_mask, dim=-1) - lb
    if ratio_mode == "product":
        return delta.clamp(-PRODUCT_LOG_RATIO_CLAMP, PRODUCT_LOG_RATIO_CLAMP)
    n = response_mask.float().sum(dim=-1).clamp(min=1.0)
    return delta / n


def token_log_ratio(log_prob: torch.Tensor, seq_log_ratio: torch.Tensor, ratio_mode: str = "geo_mean") -> torch.Tensor:
    """GSPO-token construction (docs/math.md §A.2.2): logρ̃[e,j] = sg(logρ[e]) + logp[e,j] − sg(logp[e,j]).

    Its value is logρ[e] on every token and its gradient is ∇logp[e,j], so ∂ρ̃/∂θ = ρ[e]·∂logp/∂θ.
    ``geo_mean`` additionally clamps logρ̃ ≤ 10 (verl GSPO); shape ``[B, T]``.
    """
    lp = log_prob.float()
    out = seq_log_ratio.detach().unsqueeze(-1) + lp - lp.detach()
    if ratio_mode == "geo_mean":
        out = out.clamp(max=GEO_MEAN_TOKEN_LOG_RATIO_MAX)
    return out


def _validate_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low={clip_ratio_low} must be in [0, 1) so that 1-ε_low > 0")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high={clip_ratio_high} must be >= 0")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip bound); use None or inf to turn the dual clip off"
        )


def seq_is_clipped_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    ratio_mode: str = "geo_mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    dp_size: int = 1,
    horizon: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequence-level IS-corrected clipped surrogate (docs/math.md §A.2.2-A.2.4).

    Per token, with ρ̃ from :func:`token_log_ratio`::

        L1 = −A·ρ̃ ;  L2 = −A·clip(ρ̃, 1−ε_low, 1+ε_high) ;  Lc = max(L1, L2)
        A < 0 (dual clip): L = min(Lc, −c·A)      else L = Lc

    then ``agg_loss(L, m, loss_agg_mode)`` (token-mean default; N_tok = 0 gives loss 0).

    Args:
        log_prob: ``[B, T]`` log π_θ of sampled tokens, with grad.
        old_log_prob: ``[B, T]`` behaviour log-probs, or ``[B]``. Only the masked per-sequence SUM
            Σ_j m·old enters the ratio, so per-token log-probs and "ℓb on one valid position" are equivalent.
        advantages: ``[B, T]`` (constant over tokens for outcome rewards).
        response_mask: ``[B, T]`` 0/1 (bool ok).
        ratio_mode: ``"geo_mean"`` (default, a choice, docs/math.md §E) or ``"product"``.
        clip_ratio_low/high: ε_low, ε_high (default 0.2 each).
        clip_ratio_c: dual-clip bound c > 1 (default 3.0); None or inf disables the dual clip.
        loss_agg_mode, global_tokens, global_seqs, dp_size, horizon: see ``claas_verl.utils.masked.agg_loss``.
        token_weights: optional ``[B, T]`` detached multiplier of L (verl's ``rollout_is_weights``).

    Returns:
        ``(loss, metrics)``; metrics are 0-dim detached fp32 tensors under ``actor/`` keys (the caller reduces
        them to numbers once per step; reading them here would stall the device once per key):
        ``pg_clipfrac`` (any clip, verl's key), ``pg_clipfrac_low`` (A<0, ρ<1−ε_low),
        ``pg_clipfrac_high`` (A>0, ρ>1+ε_high), ``pg_clipfrac_dual`` (= verl's ``pg_clipfrac_lower``),
        all token-weighted; ``seq_ratio_mean``, ``seq_ratio_max`` and ``seq_ratio_outside_trust_frac``
        (fraction of sequences with ρ ∉ [1−ε_low, 1+ε_high]) over sequences with n > 0.

    Raises:
        ValueError: bad mode / clip values, shape mismatch; NaN/inf on valid positions with the debug flag on
        (``CLAAS_VERL_DEBUG_CHECKS=1``, see :mod:`claas_verl.utils.host_sync`). No host sync per call.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not supported; choose one of {LOSS_AGG_MODES}")
    _validate_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    check_same_shape(log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    mask = response_mask.bool()
    check_finite("log_prob", log_prob, mask)
    check_finite("advantages", advantages, mask)
    # Zero padding positions up front so that NaN/inf there can reach neither the value nor the gradient.
    zeros = torch.zeros_like(log_prob, dtype=torch.float32)
    logp = torch.where(mask, log_prob.float(), zeros)
    adv = torch.where(mask, advantages.float(), zeros)
    if old_log_prob.dim() == 2:
        old = torch.where(mask, old_log_prob.float(), zeros)
        check_finite("old_log_prob", old_log_prob, mask)
    else:
        old = old_log_prob

    seq_lr = sequence_log_ratio(logp, old, mask, ratio_mode)
    ratio = torch.exp(token_log_ratio(logp, seq_lr, ratio_mode))  # value ρ[e] on every token

    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_clip = torch.maximum(loss1, loss2)
    dual_on = clip_ratio_c is not None and math.isfinite(clip_ratio_c)
    if dual_on:
        loss3 = -adv * clip_ratio_c
        neg = adv < 0
        loss_tok = torch.where(neg, torch.minimum(loss_clip, loss3), loss_clip)
        dual_hit = neg & (loss_clip > loss3)
    else:
        loss_tok = loss_clip
        dual_hit = torch.zeros_like(mask)
    if token_weights is not None:
        check_same_shape(token_weights=token_weights, response_mask=response_mask)
        check_finite("token_weights (rollout_is_weights)", token_weights, mask)
        loss_tok = loss_tok * torch.where(mask, token_weights.detach().float(), zeros)

    loss = agg_loss(
        loss_tok, mask, loss_agg_mode,
        global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size, horizon=horizon,
    )

    with torch.no_grad():
        clipped = loss2 > loss1
        metrics = {
            "actor/pg_clipfrac": _frac(clipped, mask),
            "actor/pg_clipfrac_low": _frac(clipped & (adv < 0), mask),
            "actor/pg_clipfrac_high": _frac(clipped & (adv > 0), mask),
            "actor/pg_clipfrac_dual": _frac(dual_hit, mask),
        }
        metrics["actor/pg_clipfrac_lower"] = metrics["actor/pg_clipfrac_dual"]  # verl's name for the same thing
        metrics.update(seq_ratio_metrics(seq_lr, mask, ratio_mode, clip_ratio_low, clip_ratio_high))
    return loss, metrics


def seq_ratio_metrics(
    seq_log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    ratio_mode: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> dict[str, torch.Tensor]:
    """Mean/max of ρ[e] and the fraction of sequences outside [1−ε_low, 1+ε_high], over rows with n>0.

    0-dim detached tensors, each 0 when no row has n>0 (the masked mean of an empty mask is 0).
    """
    valid = response_mask.bool().any(dim=-1)
    lr = seq_log_ratio.detach().float()
    if ratio_mode == "geo_mean":
        lr = lr.clamp(max=GEO_MEAN_TOKEN_LOG_RATIO_MAX)  # the ratio the loss actually used
    rho = torch.exp(lr)
    outside = (rho < 1.0 - clip_ratio_low) | (rho > 1.0 + clip_ratio_high)
    # max over valid rows without boolean indexing (a host sync): ρ = e^x >= 0, so a 0 in place of the invalid rows
    # and one extra 0 (for B = 0 or no valid row) leave the max of the valid ρ unchanged, and give 0 when none is.
    rho_valid = torch.where(valid, rho, torch.zeros_like(rho))
    return {
        "actor/seq_ratio_mean": masked_mean(rho, valid),
        "actor/seq_ratio_max": torch.cat([rho_valid, rho.new_zeros(1)]).max(),
        "actor/seq_ratio_outside_trust_frac": masked_mean(outside.float(), valid),
    }


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.float(), mask)
