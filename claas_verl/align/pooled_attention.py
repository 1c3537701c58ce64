"""Region-pooled causal attention rows, chunked over queries with recomputation (docs/math.md §B.4, B.5).

For query head h, region R and key position j in ``s0..t_last``::

    a_R^h[j] = (1/|R|) Σ_{t∈R} softmax_{j'∈[s0,t], j' real}( q_t^h · k_{j'}^{g(h)} · scale )[j]   (0 for j > t)

with ``g(h) = h // (H/G)`` (HF ``repeat_kv`` order). Padding keys never enter a softmax; each
row equals the model's own causal attention row. Rows are computed for window queries only,
``chunk_size`` queries at a time; each chunk runs under ``torch.utils.checkpoint`` so the
backward pass recomputes its ``[chunk, keys]`` probabilities instead of storing them: the full
``[queries, keys]`` matrix never exists. Math is fp32 whatever the input dtype, and also inside an
enclosing autocast (the engine's bf16 forward): autocast would run the ``.float()`` matmuls in bf16 again,
which rounds the scores to ~3 significant digits; for a teacher a few 1e-4 away from the student (a replay
snapshot) that rounding is larger than the distance SATS measures. Autocast is therefore off for this math.

The key axis of the output is ``key_start .. key_end-1`` in absolute sequence positions, shared
by the batch (``key_start`` = first real token of any row, ``key_end`` = last query of any row + 1).
Entries at padding or beyond a response's ``t_last`` are exactly 0 on both student and
teacher, so distances over this axis equal distances over each response's ``S_b`` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 256


@dataclass
class PooledRows:
    """``rows``: ``[B, H, R_max, key_end - key_start]`` fp32; ``key_start``: absolute position of key 0."""

    rows: torch.Tensor
    key_start: int


def _check(queries, keys, key_mask, region_ids):
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} must be [B, heads, T, d]")
    b, h, t, d = queries.shape
    if keys.shape[0] != b or keys.shape[2] != t or keys.shape[3] != d:
        raise ValueError(f"keys {tuple(keys.shape)} do not match queries {tuple(queries.shape)} in B, T or d")
    if h % keys.shape[1] != 0:
        raise ValueError(f"query heads H={h} must be a multiple of key heads G={keys.shape[1]} (GQA)")
    if key_mask.shape != (b, t) or region_ids.shape != (b, t):
        raise ValueError(
            f"key_mask {tuple(key_mask.shape)} and region_ids {tuple(region_ids.shape)} must be [B, T]=({b}, {t}); "
            "pad response-coordinate regions with StepRegions.pad_left(prompt_length)"
        )
    if bool(((region_ids >= 0) & ~key_mask.bool()).any()):
        raise ValueError("region_ids marks a padding position (key_mask=0) as a query; regions must lie on real tokens")


def _window_queries(region_ids: torch.Tensor):
    """Positions ``[B, Wq]`` of the query rows (region_ids >= 0), their validity and region ids."""
    is_q = region_ids >= 0
    counts = is_q.sum(-1)
    wq = int(counts.max()) if counts.numel() else 0
    # stable sort puts the query positions first, in sequence order
    order = torch.argsort((~is_q).to(torch.int8), dim=-1, stable=True)[:, :wq]
    valid = torch.arange(wq, device=region_ids.device)[None, :] < counts[:, None]
    rid = torch.where(valid, region_ids.gather(1, order), torch.full_like(order, -1))
    return order, valid, rid


def _pool_matrix(rid: torch.Tensor, r_max: int) -> torch.Tensor:
    """``[B, Wq, R_max]`` with ``1/|R|`` where query row c belongs to region R (mean over the region's rows)."""
    if rid.numel() and int(rid.max()) >= r_max:
        raise ValueError(f"region_ids holds region {int(rid.max())} but num_regions allows at most {r_max}")
    onehot = torch.nn.functional.one_hot(rid.clamp(min=0), max(r_max, 1))[..., :r_max].float()
    onehot = onehot * (rid >= 0)[..., None].float()
    sizes = onehot.sum(1, keepdim=True).clamp(min=1.0)
    return onehot / sizes


def _fp32(device: torch.device):
    """loss math in fp32 (docs/math.md §0). A region where autocast (e.g. the engine's bf16 forward) does not lower
    matmuls."""
    return torch.autocast(device_type=device.type, enabled=False)


def _chunk_rows(q_c, k, pos_c, valid_c, pool_c, key_pos, key_real, scale):
    """Pooled rows of one query chunk: ``[B, G, rep, C, d]`` queries -> ``[B, G, rep, R, Tk]``.

    Autocast is off inside, so the backward's recomputation (checkpoint) is fp32 as well."""
    with _fp32(q_c.device):
        return _chunk_rows_fp32(q_c, k, pos_c, valid_c, pool_c, key_pos, key_real, scale)


def _chunk_rows_fp32(q_c, k, pos_c, valid_c, pool_c, key_pos, key_real, scale):
    b, g, n, c, d = q_c.shape
    # fold the query heads of a KV group into the row axis: one [n*C, d] x [d, Tk] matmul per KV head,
    # without materialising k once per query head (HF repeat_kv semantics, no copy)
    scores = torch.matmul(q_c.reshape(b, g, n * c, d).float(), k.float().transpose(-1, -2)).view(b, g, n, c, -1)
    scores = scores * scale
    allowed = key_real[:, None, :] & (key_pos[None, None, :] <= pos_c[:, :, None])  # [B, C, Tk]
    # gathered filler rows (valid=0) get every key so their softmax is finite; their pool weight is 0
    allowed = allowed | ~valid_c[:, :, None]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # region means as a matmul on the left ([R, C] x [C, Tk]): keeps probs in its layout (no transposed copy)
    return torch.matmul(pool_c.transpose(1, 2)[:, None, None], probs)


def pooled_attention_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_mask: torch.Tensor,
    region_ids: torch.Tensor,
    num_regions: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    recompute: bool = True,
) -> PooledRows:
    """Region-pooled causal attention rows (docs/math.md §B.4 eq. 7; B.5 with ``queries=keys=values``).

    Args:
        queries: ``[B, H, T, d]`` (post-RoPE for SATS; values for VR). Only rows with
            ``region_ids >= 0`` are read.
        keys: ``[B, G, T, d]``, ``H % G == 0``; query head h reads key head ``h // (H/G)``.
        key_mask: ``[B, T]`` attention mask, 1 on real (prompt and response) tokens, 0 on padding.
        region_ids: ``[B, T]`` from :meth:`StepRegions.pad_left`; -1 outside regions.
        num_regions: ``[B]`` region counts (``R_max = max``); inferred from ``region_ids`` if None.
        scale: softmax scale, default ``1/sqrt(d)`` (docs/math.md §B.4).
        chunk_size: query rows per chunk.
        recompute: checkpoint each chunk when autograd records (the default and the memory-safe mode).

    Returns:
        :class:`PooledRows` with ``rows`` ``[B, H, R_max, Tk]`` fp32; zero rows for absent regions.
    """
    _check(queries, keys, key_mask, region_ids)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    b, h, _, d = queries.shape
    g = keys.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    real = key_mask.bool()
    r_max = int(num_regions.max()) if num_regions is not None and num_regions.numel() else 0
    if num_regions is None and region_ids.numel():
        r_max = int(region_ids.max()) + 1

    pos, valid, rid = _window_queries(region_ids)
    has_real = real.any(-1)
    key_start = int(torch.where(has_real, real.long().argmax(-1), real.shape[1]).min()) if b else 0
    key_end = int(pos.masked_fill(~valid, -1).max()) + 1 if valid.any() else key_start
    key_start = min(key_start, key_end)
    tk = key_end - key_start
    k = keys[:, :, key_start:key_end]
    key_pos = torch.arange(key_start, key_end, device=queries.device)
    key_real = real[:, key_start:key_end]
    pool = _pool_matrix(rid, r_max)

    wq = pos.shape[1]
    q_win = queries.gather(2, pos[:, None, :, None].expand(b, h, wq, d)).view(b, g, h // g, wq, d)
    rows = queries.new_zeros((b, g, h // g, r_max, tk), dtype=torch.float32)
    use_ckpt = recompute and torch.is_grad_enabled() and (queries.requires_grad or keys.requires_grad)
    for c0 in range(0, wq, chunk_size):
        sl = slice(c0, c0 + chunk_size)
        args = (q_win[:, :, :, sl], k, pos[:, sl], valid[:, sl], pool[:, sl], key_pos, key_real, scale)
        part = checkpoint(_chunk_rows, *args, use_reentrant=False) if use_ckpt else _chunk_rows(*args)
        rows = rows + part
    if wq == 0:
        # keep the (empty) graph connected so backward() on a region-less batch gives zero gradients
        rows = rows + q_win.sum() * 0.0 + k.sum() * 0.0
    return PooledRows(rows.reshape(b, h, r_max, tk), key_start)


def naive_pooled_attention_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_mask: torch.Tensor,
    region_ids: torch.Tensor,
    num_regions: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> PooledRows:
    """Reference: full ``[T, T]`` masked softmax per head, then per-region mean of rows. For tests/benchmarks only."""
    _check(queries, keys, key_mask, region_ids)
    b, h, t, d = queries.shape
    g = keys.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    r_max = int(num_regions.max()) if num_regions is not None and num_regions.numel() else 0
    if num_regions is None and region_ids.numel():
        r_max = int(region_ids.max()) + 1
    with _fp32(queries.device):
        k = keys.float().repeat_interleave(h // g, dim=1)  # == HF repeat_kv
        scores = torch.matmul(queries.float(), k.transpose(-1, -2)) * scale  # [B, H, T, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=queries.device).tril()
        allowed = causal[None] & key_mask.bool()[:, None, :]
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # fully padded rows: finite, never pooled
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        pool = _pool_matrix(region_ids, r_max)  # [B, T, R]
        rows = torch.einsum("bhct,bcr->bhrt", probs, pool)
    real = key_mask.bool()
    is_q = region_ids >= 0
    key_start = int(torch.where(real.any(-1), real.long().argmax(-1), t).min()) if b else 0
    arange = torch.arange(t, device=queries.device)
    key_end = int(torch.where(is_q, arange, -1).max()) + 1 if is_q.any() else key_start
    key_start = min(key_start, key_end)
    return PooledRows(rows[..., key_start:key_end], key_start)
