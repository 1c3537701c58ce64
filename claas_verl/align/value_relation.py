"""Value relation (VR) term (docs/math.md §B.5): MiniLM's value relation, causal, region-pooled, squared error.

    b_R^{l,g}[j] = (1/|R|) Σ_{t∈R} softmax_{j'∈[s0,t]}( v_t^{l,g}·v_{j'}^{l,g} / √d_head )[j]      per KV head g
    ℓ_VR(mb) = (1/|Y|) Σ_y (1/|R_y|) Σ_R (1/G) Σ_g Σ_{l∈L} ‖b_{S,R}^{l,g} − b_{T,R}^{l,g}‖²

v are value-projection outputs without RoPE. The loss is :func:`claas_verl.align.sats.pooled_rows_loss`.
"""

from __future__ import annotations

import torch

from claas_verl.align.pooled_attention import DEFAULT_CHUNK, PooledRows, pooled_attention_rows
from claas_verl.align.sats import pooled_rows_loss


def value_relation_rows(
    values: torch.Tensor,
    key_mask: torch.Tensor,
    region_ids: torch.Tensor,
    num_regions: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> PooledRows:
    """Pooled value-relation rows of one layer: ``values [B, G, T, d]`` -> ``[B, G, R_max, Tk]`` (B.5)."""
    return pooled_attention_rows(values, values, key_mask, region_ids, num_regions, scale=scale, chunk_size=chunk_size)


value_relation_loss = pooled_rows_loss
