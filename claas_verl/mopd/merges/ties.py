"""Merges without training: TIES and the uniform average (docs/math.md §B.10; MOPD paper App. "Merges"; TIES, Yadav et
al. 2023).

All functions take state dicts (``Mapping[str, Tensor]``; any lazy mapping works, see
:mod:`claas_verl.mopd.merges.io`) and return ``dict[str, Tensor]``. Floating tensors are merged;
non-float tensors are copied from the base. The task vector of model i is flattened over
ALL float parameters (no keys removed, a choice, docs/math.md §E), d entries in total:

    τ_i      = θ_i − θ_0                                         in fp32
    trim     : k = d − ⌊ρ·d⌋ (ρ = density = 0.2);  thr_i = kthvalue(|τ_i|, k) (1-indexed k-th smallest)
               τ̂_i = τ_i · [|τ_i| ≥ thr_i]                      ⌊ρd⌋+1 entries plus ties; thr = 0 (keep all)
                                                                 when more than (1−ρ)·d entries are 0
    elect    : σ = sign(Σ_i τ̂_i);  where σ = 0: σ = sign(Σ_entries σ)   (whole-vector majority, may stay 0)
    disjoint : keep_i = (τ̂_i > 0) if σ > 0 else (τ̂_i < 0)      (σ still 0: the negative entries, as the
               merged = Σ_i τ̂_i·keep_i / max(#{i: τ̂_i·keep_i ≠ 0}, 1)    reference code does)
    θ        = θ_0 + λ·merged                                    λ = 1

Two global quantities make TIES non-local: each trim threshold (over the whole flattened τ_i)
and the majority sign. :func:`ties_merge` therefore runs parameter by parameter in passes
over the state dicts, holding one parameter of each model at a time:

1. thresholds, ``threshold_method="streaming"`` (default): an exact two-pass radix select on
   the float32 bit patterns of |τ_i| (for non-negative floats the int32 view is ordered like the
   values). Pass 1 counts the high 16 bits of every entry (65,536 bins), which locates the bin
   of the k-th smallest; pass 2 counts the low 16 bits inside that bin, which gives the exact
   k-th value. Memory: two histograms per model. ``"flat"``: one concatenation of |τ_i| per
   model and ``torch.kthvalue`` (d floats of memory). Both return the same threshold.
2. majority sign: Σ over all entries of sign(Σ_i τ̂_i), accumulated per parameter.
3. merge per parameter, yielded in base key order (:func:`iter_ties_merge`).

:func:`ties_merge_flat` is the literal whole-vector computation of the reference code (one
[N, d] matrix); tests check that both give identical tensors.

Uses: TIES of the experts (``ties_merge(θ_0, [E_1..E_5])``), TIES of the Seq snapshots
(``ties_merge(θ_0, [M_1..M_5])``), stage-by-stage TIES (:func:`ties_stagewise`) and the uniform
average of the experts (:func:`uniform_average`). Torch only; no ray, no verl.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

StateDict = Mapping[str, torch.Tensor]
THRESHOLD_METHODS = ("streaming", "flat")
_BINS = 1 << 16


# ------------------------------------------------------------------------------------------------
# Building blocks on flat [N, d] task-vector matrices (the reference formulation)
# ------------------------------------------------------------------------------------------------

def _check_density(density: float) -> None:
    if not (isinstance(density, (int, float)) and 0.0 <= density <= 1.0):
        raise ValueError(f"density (share of entries kept per task vector) must be in [0, 1], got {density!r}")


def trim_k(d: int, density: float) -> int:
    """The 1-indexed rank k = d − ⌊density·d⌋ of the trim threshold among the d magnitudes (smallest first)."""
    _check_density(density)
    if d < 1:
        raise ValueError("a task vector needs at least one float entry (d ≥ 1)")
    k = d - int(d * density)  # int() floors a non-negative float, as the reference code's int(d * K)
    return max(k, 1)  # density = 1 keeps everything (threshold = the smallest magnitude)


def trim(tau: torch.Tensor, density: float = 0.2) -> torch.Tensor:
    """Row-wise trim of task vectors ``tau`` [N, d] (or [d]).

    Keeps |τ| ≥ kthvalue(|τ|, d − ⌊density·d⌋) (ties included) and zeroes the rest.
    """
    t = tau if tau.dim() == 2 else tau.reshape(1, -1)
    thr = t.abs().kthvalue(trim_k(t.shape[1], density), dim=1, keepdim=True).values
    return (t * (t.abs() >= thr)).reshape(tau.shape)


def elect_sign(trimmed: torch.Tensor, majority: torch.Tensor | float | None = None) -> torch.Tensor:
    """σ = sign(Σ_i τ̂_i) over dim 0 of ``trimmed`` [N, ...]; zeros replaced by the majority sign.

    ``majority`` defaults to sign(Σ_entries σ) over this tensor; pass the whole-model value when
    ``trimmed`` holds one parameter only.
    """
    sigma = torch.sign(trimmed.sum(dim=0))
    if majority is None:
        majority = torch.sign(sigma.sum())
    return torch.where(sigma == 0, torch.as_tensor(majority, dtype=sigma.dtype), sigma)


def disjoint_mean(trimmed: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 of the entries of ``trimmed`` [N, ...] whose sign equals ``sign`` / their nonzero count.

    Where ``sign`` is 0 the negative entries are kept (reference behaviour); the count is clamped ≥ 1.
    """
    keep = torch.where(sign.unsqueeze(0) > 0, trimmed > 0, trimmed < 0)
    selected = trimmed * keep
    count = (selected != 0).sum(dim=0).clamp_min(1)
    return selected.sum(dim=0) / count


# ------------------------------------------------------------------------------------------------
# State-dict helpers
# ------------------------------------------------------------------------------------------------

def _float_keys(base: StateDict, models: Sequence[StateDict], names: str = "models") -> list[str]:
    if not isinstance(base, Mapping):
        raise ValueError(f"base must be a state dict (name → tensor), got {type(base).__name__}")
    if isinstance(models, Mapping) or len(models) == 0:
        raise ValueError(f"{names} must be a non-empty list of state dicts")
    keys = list(base.keys())
    for i, m in enumerate(models):
        if set(m.keys()) != set(keys):
            extra, miss = sorted(set(m.keys()) - set(keys))[:5], sorted(set(keys) - set(m.keys()))[:5]
            raise ValueError(f"{names}[{i}] has other parameter names than the base (extra {extra}, missing {miss}); "
                             "all models must share the base architecture")
    fkeys = []
    for k in keys:
        b = base[k]
        if not b.is_floating_point():
            continue
        for i, m in enumerate(models):
            if tuple(m[k].shape) != tuple(b.shape) or not m[k].is_floating_point():
                raise ValueError(f"{names}[{i}][{k!r}] has shape {tuple(m[k].shape)} / dtype {m[k].dtype}, "
                                 f"the base has {tuple(b.shape)} / {b.dtype}")
        fkeys.append(k)
    if not fkeys:
        raise ValueError("base has no floating-point parameters to merge")
    return fkeys


def _task_vectors(base: StateDict, models: Sequence[StateDict], key: str) -> torch.Tensor:
    """[N, numel] fp32 task vectors τ_i = θ_i − θ_0 of one parameter."""
    b = base[key].detach().to(torch.float32).reshape(-1)
    return torch.stack([m[key].detach().to(torch.float32).reshape(-1) - b for m in models])


def _check_finite(tau: torch.Tensor, key: str) -> None:
    if not torch.isfinite(tau).all():
        raise ValueError(f"non-finite task vector entries in parameter {key!r}: a model or the base holds NaN/inf")


# ------------------------------------------------------------------------------------------------
# Trim thresholds over the whole model
# ------------------------------------------------------------------------------------------------

def _kth_bin(hist: torch.Tensor, k: int) -> tuple[int, int]:
    """Bin holding the k-th smallest (1-indexed) of a histogram, and the rank inside that bin."""
    cum = hist.cumsum(0)
    b = int(torch.searchsorted(cum, torch.tensor(k, dtype=cum.dtype)))
    below = int(cum[b - 1]) if b > 0 else 0
    return b, k - below


def trim_thresholds(chunks: Callable[[], Iterable[torch.Tensor]], density: float = 0.2,
                    method: str = "streaming") -> torch.Tensor:
    """Per-row trim thresholds thr_i = kthvalue(|τ_i|, d − ⌊density·d⌋) of N task vectors given in column chunks.

    ``chunks()`` must return a fresh iterable of fp32 tensors [N, n_j] (one per parameter, say) whose
    concatenation along dim 1 is the flattened [N, d] task-vector matrix; it is called twice by
    ``"streaming"`` (exact radix select, memory O(N·65,536)) and once by ``"flat"`` (concatenation,
    memory O(N·d)). Returns thr [N] (fp32).
    """
    _check_density(density)
    if method not in THRESHOLD_METHODS:
        raise ValueError(f"threshold method must be one of {THRESHOLD_METHODS}, got {method!r}")
    if method == "flat":
        mat = torch.cat([c.abs() for c in chunks()], dim=1)
        return mat.kthvalue(trim_k(mat.shape[1], density), dim=1).values

    # Pass 1: histogram of the high 16 bits of the float32 patterns of |τ| (sign bit 0 ⇒ int order = float order).
    hists: torch.Tensor | None = None
    d = 0
    for c in chunks():
        bits = c.abs().to(torch.float32).contiguous().view(torch.int32)
        hi = bits >> 16
        if hists is None:
            hists = torch.zeros(c.shape[0], _BINS, dtype=torch.int64)
        for i in range(c.shape[0]):
            hists[i] += torch.bincount(hi[i], minlength=_BINS)
        d += c.shape[1]
    if hists is None:
        raise ValueError("chunks() yielded no task-vector entries")
    k = trim_k(d, density)
    located = [_kth_bin(hists[i], k) for i in range(hists.shape[0])]
    # Pass 2: inside the located high bin, histogram of the low 16 bits → the exact k-th bit pattern.
    lows = torch.zeros(hists.shape[0], _BINS, dtype=torch.int64)
    for c in chunks():
        bits = c.abs().to(torch.float32).contiguous().view(torch.int32)
        for i, (hb, _) in enumerate(located):
            sel = bits[i][(bits[i] >> 16) == hb]
            if sel.numel():
                lows[i] += torch.bincount(sel & 0xFFFF, minlength=_BINS)
    out = torch.empty(hists.shape[0], dtype=torch.int32)
    for i, (hb, rank) in enumerate(located):
        lb, _ = _kth_bin(lows[i], rank)
        out[i] = (hb << 16) | lb
    return out.view(torch.float32)


# ------------------------------------------------------------------------------------------------
# TIES
# ------------------------------------------------------------------------------------------------

def iter_ties_merge(base: StateDict, models: Sequence[StateDict], density: float = 0.2, lam: float = 1.0,
                    out_dtype: torch.dtype | None = None, threshold_method: str = "streaming",
                    stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """TIES of ``models`` around ``base``, parameter by parameter; yields ``(name, tensor)`` in base key order.

    Float tensors: θ_0 + λ·merged computed in fp32, cast to ``out_dtype`` (default: the base
    tensor's dtype). Non-float tensors: the base's. See the module docstring for the passes.
    ``stats`` (a dict, optional) receives ``d``, ``thresholds`` [N], ``kept_fraction`` [N] and
    ``majority_sign`` before the first tensor is yielded.
    """
    fkeys = _float_keys(base, models)
    if not math.isfinite(lam):
        raise ValueError(f"lam (scale of the merged task vector) must be finite, got {lam!r}")

    def chunks() -> Iterator[torch.Tensor]:
        for key in fkeys:
            tau = _task_vectors(base, models, key)
            _check_finite(tau, key)
            yield tau

    thr = trim_thresholds(chunks, density, threshold_method).unsqueeze(1)  # [N, 1]

    # Whole-vector majority sign of the elected signs (the σ = 0 fallback).
    total, kept, d = 0, torch.zeros(len(models), dtype=torch.int64), 0
    for key in fkeys:
        tau = _task_vectors(base, models, key)
        mask = tau.abs() >= thr
        total += int(torch.sign((tau * mask).sum(dim=0)).sum())
        kept += mask.sum(dim=1)
        d += tau.shape[1]
    majority = float((total > 0) - (total < 0))
    if stats is not None:
        stats.update(d=d, thresholds=thr.squeeze(1).tolist(), kept_fraction=[int(c) / d for c in kept],
                     majority_sign=majority)

    fset = set(fkeys)
    for key, b in base.items():
        if key not in fset:
            yield key, b
            continue
        tau = _task_vectors(base, models, key)
        trimmed = tau * (tau.abs() >= thr)
        merged = disjoint_mean(trimmed, elect_sign(trimmed, majority))
        theta = b.detach().to(torch.float32).reshape(-1) + lam * merged
        yield key, theta.reshape(b.shape).to(out_dtype or b.dtype)


def ties_merge(base: StateDict, models: Sequence[StateDict], density: float = 0.2, lam: float = 1.0,
               out_dtype: torch.dtype | None = None, threshold_method: str = "streaming",
               stats: dict | None = None) -> dict[str, torch.Tensor]:
    """TIES merge (docs/math.md §B.10) of ``models`` (experts E_1..E_K, or snapshots M_1..M_K) around ``base`` θ_0.

    Parameter-by-parameter passes (:func:`iter_ties_merge`); identical to :func:`ties_merge_flat`.
    """
    return dict(iter_ties_merge(base, models, density, lam, out_dtype, threshold_method, stats))


def ties_merge_flat(base: StateDict, models: Sequence[StateDict], density: float = 0.2, lam: float = 1.0,
                    out_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """TIES computed on one flattened [N, d] task-vector matrix, as the reference code does (small models, tests)."""
    fkeys = _float_keys(base, models)
    tau = torch.cat([_task_vectors(base, models, k) for k in fkeys], dim=1)
    _check_finite(tau, "<all>")
    trimmed = trim(tau, density)
    merged = disjoint_mean(trimmed, elect_sign(trimmed))
    out: dict[str, torch.Tensor] = {}
    offset = 0
    fset = set(fkeys)
    sizes = {k: base[k].numel() for k in fkeys}
    for key in fkeys:  # offsets follow the concatenation order
        n = sizes[key]
        b = base[key]
        out[key] = (b.detach().to(torch.float32).reshape(-1) + lam * merged[offset:offset + n]).reshape(b.shape).to(
            out_dtype or b.dtype)
        offset += n
    return {k: (out[k] if k in fset else v) for k, v in base.items()}


def iter_ties_stagewise(base: StateDict, models: Sequence[StateDict], density: float = 0.2, lam: float = 1.0,
                        store_dtype: torch.dtype = torch.bfloat16, threshold_method: str = "streaming",
                        ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Stage-by-stage TIES (docs/math.md §B.10): yields ``(k, m_k)`` for k = 1..K (1-based).

    m_1 = E_1 (float tensors cast to ``store_dtype``); m_k = θ_0 + TIES({m_{k−1} − θ_0, E_k − θ_0})
    for k ≥ 2, each task vector trimmed anew, computed in fp32 and stored in ``store_dtype``
    (bf16): the next stage reads that rounded copy. Only θ_0, m_{k−1} and E_k are needed at stage k.
    """
    fset = set(_float_keys(base, models))
    current = {k: (v.detach().to(store_dtype) if k in fset else base[k]) for k, v in models[0].items()}
    yield 1, current
    for k in range(1, len(models)):
        current = ties_merge(base, [current, models[k]], density, lam, store_dtype, threshold_method)
        yield k + 1, current


def ties_stagewise(base: StateDict, models: Sequence[StateDict], density: float = 0.2, lam: float = 1.0,
                   store_dtype: torch.dtype = torch.bfloat16, threshold_method: str = "streaming",
                   ) -> dict[str, torch.Tensor]:
    """The final stage-by-stage TIES merge m_K (see :func:`iter_ties_stagewise`)."""
    last: dict[str, torch.Tensor] = {}
    for _k, m_k in iter_ties_stagewise(base, models, density, lam, store_dtype, threshold_method):
        last = m_k  # keep only the newest stage: earlier ones are released
    return last


def uniform_average(models: Sequence[StateDict], out_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Elementwise mean of the models' float tensors (fp32 accumulation); non-float tensors from ``models[0]``.

    Output dtype: ``out_dtype`` or that of ``models[0]``'s tensor.
    """
    if isinstance(models, Mapping) or len(models) == 0:
        raise ValueError("models must be a non-empty list of state dicts")
    first = models[0]
    fset = set(_float_keys(first, models[1:], "models[1:]")) if len(models) > 1 else {
        k for k, v in first.items() if v.is_floating_point()}
    out = {}
    for key, v in first.items():
        if key not in fset:
            out[key] = v
            continue
        acc = torch.zeros(v.shape, dtype=torch.float32)
        for m in models:
            acc += m[key].detach().to(torch.float32)
        out[key] = (acc / len(models)).to(out_dtype or v.dtype)
    return out
