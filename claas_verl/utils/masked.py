"""Masked reductions and loss aggregation (docs/math.md §0 and §C), torch only.

Every "mean over tokens" in claas_verl goes through this module, so that the
loss stays invariant to how a batch is split across data-parallel ranks and
micro-batches (STYLE: one aggregation path). The formulas follow verl's
``agg_loss`` of the pinned version but are written here so the math modules
never import verl.

Sharding contract: a caller that holds one shard of a global batch passes the
*global* normaliser (``global_tokens`` or ``global_seqs``) and ``dp_size``;
summing the per-shard results divided by ``dp_size`` (what gradient averaging
does) then equals the unsharded value.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ x·m with non-finite values outside the mask zeroed (they never leak in as NaN·0)."""
    m = mask.to(x.dtype)
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return (x * m).sum() if dim is None else (x * m).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None, eps: float = 1e-8) -> torch.Tensor:
    """Σ x·m / (Σ m + eps) (docs/math.md §0). An empty mask gives 0, never NaN."""
    den = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / (den + eps)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    dp_size: int = 1,
    horizon: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar (docs/math.md §A.2.4, §C).

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` response mask (1 on generated tokens incl. EOS, 0 on padding).
        mode: one of :data:`LOSS_AGG_MODES`.
        global_tokens: Σm over the whole global batch (all ranks, all micro-batches)
            for ``token-mean``; defaults to this tensor's Σm.
        global_seqs: number of sequences with Σm>0 in the global batch for the
            ``seq-mean-*`` modes; defaults to this tensor's count.
        dp_size: data-parallel world size (gradients are averaged over ranks,
            so each shard's share is multiplied back by ``dp_size``).
        horizon: ``T_r`` for ``seq-mean-token-sum-norm``; defaults to ``T``.

    Returns:
        A scalar. An all-zero mask gives exactly 0 (A.2.4 edge case), never NaN.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not supported; choose one of {LOSS_AGG_MODES}")
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        den = m.sum() if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / _clamp_den(den) * dp_size
    if mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    seq_tokens = m.sum(dim=-1)
    valid_seq = (seq_tokens > 0).to(loss_mat.dtype)
    seq_sum = masked_sum(loss_mat, mask, dim=-1)
    n_seq = valid_seq.sum() if global_seqs is None else global_seqs
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1)
        return (per_seq * valid_seq).sum() / _clamp_den(n_seq) * dp_size
    loss = (seq_sum * valid_seq).sum() / _clamp_den(n_seq) * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mat.shape[-1] if horizon is None else horizon)
    return loss


def _clamp_den(den):
    if isinstance(den, torch.Tensor):
        return den.clamp(min=1)
    return max(float(den), 1.0)
