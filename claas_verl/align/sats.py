"""SATS: reasoning-step pooled attention term (docs/math.md §B.4, MOPD paper eqs. 7-8).

    ℓ_SATS(mb) = (1/|Y|) Σ_{y∈Y} (1/|R_y|) Σ_{R∈R_y} (1/H) Σ_h Σ_{l∈L} ‖a_{S,R}^{l,h} − a_{T,R}^{l,h}‖²₂

Squared distance of the layer-concatenated vectors (= sum over layers), mean over heads (matched by
index), over the regions of a response, and over the responses Y with at least one region. The
value-relation term (B.5) has the same form over KV heads and reuses :func:`pooled_rows_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from claas_verl.align.pooled_attention import DEFAULT_CHUNK, PooledRows, pooled_attention_rows
from claas_verl.align.targets import TermValue, to_bf16_target
from claas_verl.utils.masked import agg_loss

PAPER_SATS_LAYERS = (6, 13, 20, 27)  # MOPD paper: the last layer of each quarter of the 28-layer student


def default_sats_layers(num_layers: int) -> list[int]:
    """The last layer of each quarter: ``{⌊(i+1)·n/4⌋ − 1}``; gives the MOPD paper's {6, 13, 20, 27} for n = 28.

    For other depths this keeps the paper's rule rather than clipping the literal indices.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    return sorted({max((i + 1) * num_layers // 4 - 1, 0) for i in range(4)})


def sats_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_mask: torch.Tensor,
    region_ids: torch.Tensor,
    num_regions: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> PooledRows:
    """Pooled attention rows ``a_R^{l,h}`` of one layer: post-RoPE ``queries [B,H,T,d]``, ``keys [B,G,T,d]`` (B.4)."""
    return pooled_attention_rows(
        queries, keys, key_mask, region_ids, num_regions, scale=scale, chunk_size=chunk_size
    )


def pooled_rows_loss(
    student_rows: Sequence[PooledRows | torch.Tensor],
    teacher_rows: Sequence[PooledRows | torch.Tensor],
    num_regions: torch.Tensor,
) -> TermValue:
    """ℓ_SATS (B.4) or ℓ_VR (B.5) of one micro-batch from per-layer pooled rows.

    Args:
        student_rows: per layer in ``L``, ``[B, heads, R_max, Tk]`` (differentiable).
        teacher_rows: the same layers and shapes; detached and rounded to bf16 here (idempotent).
        num_regions: ``[B]`` ``|R_y|``; regions ``r >= |R_y|`` are ignored.

    Returns:
        :class:`TermValue` with ``count = |Y|``; loss 0 with zero gradient when no response has a region.
    """
    if len(student_rows) != len(teacher_rows) or not student_rows:
        raise ValueError(
            f"student_rows has {len(student_rows)} layers, teacher_rows {len(teacher_rows)}; need the same non-empty L"
        )
    total = None
    for s, t in zip(student_rows, teacher_rows):
        if isinstance(s, PooledRows) and isinstance(t, PooledRows) and s.key_start != t.key_start:
            raise ValueError(f"student key_start {s.key_start} != teacher {t.key_start}: same masks and regions needed")
        s = s.rows if isinstance(s, PooledRows) else s
        t = t.rows if isinstance(t, PooledRows) else t
        if s.shape != t.shape or s.dim() != 4:
            raise ValueError(f"student rows {tuple(s.shape)} != teacher rows {tuple(t.shape)} (want [B, heads, R, Tk])")
        per_region = (s.float() - to_bf16_target(t).float()).pow(2).sum(-1).mean(1)  # Σ_j, then 1/H Σ_h: [B, R]
        total = per_region if total is None else total + per_region  # Σ_l
    r = total.shape[1]
    region_mask = torch.arange(r, device=total.device)[None, :] < num_regions.to(total.device)[:, None]
    # seq-mean-token-mean over [B, R] = (1/|Y|) Σ_y (1/|R_y|) Σ_R, responses without regions excluded
    loss = agg_loss(total, region_mask, "seq-mean-token-mean")
    return TermValue(loss=loss, count=int((num_regions > 0).sum()), n_responses=int(num_regions.shape[0]))


sats_loss = pooled_rows_loss
