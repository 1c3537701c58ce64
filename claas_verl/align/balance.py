"""Gradient-norm balancing of the token and alignment gradients (SPEC §B.6, 003 eqs. 9-10).

A gradient is either one flat tensor or a list of per-parameter tensors (``None`` = no gradient for that
parameter, read as zeros). Every function returns its combination in the same form as its inputs.

Distributed reduction. Norms and inner products are sums of per-element products, so each rank computes its
local partial sums and one ``all_reduce(SUM)`` over ``group`` completes them (SPEC B.6: reduced over all shards
and ranks, before clipping):

- FSDP2 (``fully_shard``): ``param.grad`` is a DTensor sharded over the data-parallel mesh; the partial sums use
  ``grad.to_local()`` and the all-reduce runs over the mesh's process group (``group=mesh.get_group()``). The
  linear combinations are applied to the DTensors themselves, which keeps their placements. With HSDP
  (replicate × shard) pass the *shard* group only; reducing over replicas too would count each shard twice.
- DDP, or any setting where every rank holds the full gradient: pass ``sync=False``. (Reducing anyway scales every
  squared norm by the world size; the combined gradient is unchanged because eqs. 9-10 only use norm *ratios*
  and cosines, but the logged norms would be off by √world_size.)
- ``sync=None`` (default): reduce iff ``torch.distributed`` is initialised.

Every rank of ``group`` must call these functions with the same terms, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

GradLike = torch.Tensor | Sequence[torch.Tensor | None]

# SPEC B.6 [CHOICE]: a gradient with norm below this is "zero" (ĝ := 0; eq. 9 falls back to g = g_tok).
ZERO_NORM = 1e-30


# ----------------------------------------------------------------------------------------------------------------
# helpers over GradLike


def _as_list(g: GradLike | None, name: str) -> tuple[list, bool] | tuple[None, None]:
    if g is None:
        return None, None
    if isinstance(g, torch.Tensor):
        return [g], True
    if isinstance(g, (list, tuple)):
        for i, t in enumerate(g):
            if t is not None and not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}[{i}] must be a torch.Tensor or None; got {type(t).__name__}")
        return list(g), False
    raise ValueError(f"{name} must be a flat tensor or a list of per-parameter tensors (None allowed); got {type(g)}")


def _gather_terms(**terms) -> tuple[dict[str, list | None], bool, int]:
    """Normalise every term to a list; check they agree in form, length and shapes."""
    lists, form, length = {}, None, None
    for name, g in terms.items():
        lst, flat = _as_list(g, name)
        lists[name] = lst
        if lst is None:
            continue
        if form is None:
            form, length = flat, len(lst)
        elif flat != form or len(lst) != length:
            raise ValueError(
                f"{name} does not match the other gradients: all must be flat tensors, or lists of the same length "
                f"(got {'a flat tensor' if flat else f'a list of {len(lst)}'})"
            )
    if form is None:
        raise ValueError(f"at least one of {list(terms)} must be a gradient; all are None")
    for i in range(length):
        shapes = {n: tuple(lst[i].shape) for n, lst in lists.items() if lst is not None and lst[i] is not None}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"gradient entry {i} has mismatched shapes across terms: {shapes}")
    return lists, form, length


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 DTensor gradients: each rank sums over its own shard; the all-reduce adds the shards up.
    return t.to_local() if hasattr(t, "to_local") else t


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _dot_local(a: list | None, b: list | None, device) -> torch.Tensor:
    """Σ_i <a_i, b_i> over local shards, fp64 accumulator (per-tensor partials in ≥ fp32)."""
    acc = torch.zeros((), dtype=torch.float64, device=device)
    if a is None or b is None:
        return acc
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        xl, yl = _local(x), _local(y)
        dt = _acc_dtype(xl) if _acc_dtype(xl) == _acc_dtype(yl) else torch.float64
        acc = acc + torch.sum(xl.to(dt) * yl.to(dt)).to(torch.float64)
    return acc


def _device_of(lists: dict) -> torch.device:
    for lst in lists.values():
        for t in lst or ():
            if t is not None:
                return _local(t).device
    return torch.device("cpu")


def _do_sync(sync: bool | None) -> bool:
    available = torch.distributed.is_available() and torch.distributed.is_initialized()
    if sync and not available:
        raise ValueError("sync=True needs an initialised torch.distributed process group; use sync=None or False")
    return available if sync is None else bool(sync)


def _reduced_products(lists: dict, pairs: Sequence[tuple[str, str]], sync: bool | None, group) -> list[float]:
    """All requested inner products, all-reduced in ONE collective (SUM of local partial sums)."""
    device = _device_of(lists)
    vals = torch.stack([_dot_local(lists[a], lists[b], device) for a, b in pairs])
    if _do_sync(sync):
        torch.distributed.all_reduce(vals, op=torch.distributed.ReduceOp.SUM, group=group)
    return [float(v) for v in vals.cpu()]


def _lincomb(coefs: dict[str, float], lists: dict, form_flat: bool, length: int) -> GradLike:
    """Σ_name coef·g_name, entry by entry; an entry that is None in every used term stays None."""
    out = []
    for i in range(length):
        acc = None
        for name, c in coefs.items():
            lst = lists.get(name)
            if lst is None or lst[i] is None:
                continue
            x = lst[i]
            term = x * c if c != 1.0 else x.clone()
            acc = term if acc is None else acc.add_(term)
        if acc is None:
            present = [lists[n][i] for n in coefs if lists.get(n) is not None and lists[n][i] is not None]
            acc = torch.zeros_like(present[0]) if present else None
        out.append(acc)
    return out[0] if form_flat else out


def _zeros_like_form(lists: dict, form_flat: bool, length: int, name: str) -> GradLike:
    out = [None if t is None else torch.zeros_like(t) for t in lists[name]]
    return out[0] if form_flat else out


def _check_ratio(x: float, name: str) -> float:
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0; got {x!r}")
    return x


def grad_norm(g: GradLike, *, sync: bool | None = None, group=None) -> float:
    """‖g‖₂ over all entries (and all ranks/shards, see the module docstring)."""
    lists, _, _ = _gather_terms(g=g)
    return math.sqrt(max(_reduced_products(lists, [("g", "g")], sync, group)[0], 0.0))


# ----------------------------------------------------------------------------------------------------------------
# eq. (9)


def balance(
    g_tok: GradLike, g_aux: GradLike | None, ratio: float = 1.0, *, sync: bool | None = None, group=None
) -> tuple[GradLike, dict[str, float]]:
    """Combine token and auxiliary gradients at target norm ratio ``r`` (SPEC B.6, 003 eq. 9, unified form).

    ``g = min(1, r)·g_tok + min(1, 1/r)·‖g_tok‖·ĝ_aux``, so ‖token part‖ / ‖aux part‖ = r, and
    ``‖g‖² = ‖g_tok‖²·(a² + b² + 2ab·cos φ)`` with ``a = min(1, r)``, ``b = min(1, 1/r)``, φ = ∠(g_tok, g_aux).

    Edge cases ``[CHOICE]``: ‖g_tok‖ = 0 gives g = 0; otherwise ‖g_aux‖ < 1e-30 (or ``g_aux is None``) gives
    g = g_tok (also for r < 1: no aux direction means nothing to balance against).

    Args:
        g_tok, g_aux: flat tensors, or lists of per-parameter tensors (None entries allowed), in the same form.
        ratio: r > 0 (003 default 1).
        sync, group: cross-rank reduction of norms and the inner product (module docstring).

    Returns:
        ``(g, info)``: g in the input form; info holds ``scale`` (logged c = ‖g_tok‖/‖g_aux‖, 0 when undefined),
        ``tok_norm``, ``aux_norm``, ``cos_tok_aux``, ``tok_coef`` (a), ``aux_coef`` (multiplier of the raw g_aux:
        b·c), ``final_norm`` (from the formula above) and ``fallback`` (0 none, 1 g_aux = 0, 2 g_tok = 0).
    """
    r = _check_ratio(ratio, "ratio")
    lists, flat, n = _gather_terms(g_tok=g_tok, g_aux=g_aux)
    if lists["g_tok"] is None:
        raise ValueError("g_tok is required (it sets the scale of the update); got None")
    tt, aa, ta = _reduced_products(lists, [("g_tok", "g_tok"), ("g_aux", "g_aux"), ("g_tok", "g_aux")], sync, group)
    tok_norm, aux_norm = math.sqrt(max(tt, 0.0)), math.sqrt(max(aa, 0.0))
    cos = ta / (tok_norm * aux_norm) if tok_norm > 0 and aux_norm >= ZERO_NORM else 0.0
    info = {"tok_norm": tok_norm, "aux_norm": aux_norm, "cos_tok_aux": cos, "ratio": r}
    if tok_norm == 0.0:
        info.update(scale=0.0, tok_coef=0.0, aux_coef=0.0, final_norm=0.0, fallback=2.0)
        return _zeros_like_form(lists, flat, n, "g_tok"), info
    if aux_norm < ZERO_NORM:
        info.update(scale=0.0, tok_coef=1.0, aux_coef=0.0, final_norm=tok_norm, fallback=1.0)
        return _lincomb({"g_tok": 1.0}, lists, flat, n), info
    a, b = min(1.0, r), min(1.0, 1.0 / r)
    c = tok_norm / aux_norm
    final_sq = tok_norm**2 * (a * a + b * b + 2 * a * b * cos)
    info.update(scale=c, tok_coef=a, aux_coef=b * c, final_norm=math.sqrt(max(final_sq, 0.0)), fallback=0.0)
    return _lincomb({"g_tok": a, "g_aux": b * c}, lists, flat, n), info


# ----------------------------------------------------------------------------------------------------------------
# eq. (10)


def combine_aux(
    g_sats: GradLike | None,
    g_vr: GradLike | None,
    g_hid: GradLike | None,
    rho: float = 2.0,
    *,
    sync: bool | None = None,
    group=None,
) -> tuple[GradLike, dict[str, float]]:
    """FSAR auxiliary direction ``g_aux = u + ρ·ĝ_hid``, ``u = s/‖s‖``, ``s = ĝ_SATS + ĝ_VR`` (SPEC B.6, eq. 10).

    Unit-vector convention ``[CHOICE]``: ĝ := 0 when ‖g‖ < 1e-30 (each term separately, and u := 0 when ‖s‖ is),
    so a step without any region gives g_aux = ρ·ĝ_hid, never NaN. A term passed as ``None`` is treated as zero,
    which also covers the two-term variants (e.g. Replay-KL + SATS: ``combine_aux(g_sats, None, None)``).
    ‖s‖ = √(2 + 2cos(g_SATS, g_VR)) and ‖g_aux‖ = √(1 + ρ² + 2ρ·cos(u, g_hid)) when all are non-zero.

    Returns:
        ``(g_aux, info)`` with ``sats_norm``, ``vr_norm``, ``hid_norm``, ``cos_sats_vr``, ``s_norm``,
        ``cos_u_hid`` and ``aux_norm`` (= ‖g_aux‖). Pass g_aux on to :func:`balance`; only its direction matters.
    """
    rho = float(rho)
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"rho must be a finite number >= 0; got {rho!r}")
    lists, flat, n = _gather_terms(g_sats=g_sats, g_vr=g_vr, g_hid=g_hid)
    S, R, H = "g_sats", "g_vr", "g_hid"
    pairs = [(S, S), (R, R), (H, H), (S, R), (S, H), (R, H)]
    ss, vv, hh, sv, sh, vh = _reduced_products(lists, pairs, sync, group)
    ns, nv, nh = (math.sqrt(max(x, 0.0)) for x in (ss, vv, hh))
    # 1/‖g‖ of each unit vector, 0 for a zero gradient (ĝ := 0)
    inv_s, inv_v, inv_h = (1.0 / x if x >= ZERO_NORM else 0.0 for x in (ns, nv, nh))
    cos_sv = sv * inv_s * inv_v
    s_sq = (1.0 if inv_s else 0.0) + (1.0 if inv_v else 0.0) + 2.0 * cos_sv  # ‖ĝ_S + ĝ_V‖²
    s_norm = math.sqrt(max(s_sq, 0.0))
    inv_snorm = 1.0 / s_norm if s_norm >= ZERO_NORM else 0.0
    u_dot_hhat = (sh * inv_s + vh * inv_v) * inv_h * inv_snorm  # cos(u, g_hid) when both non-zero
    u_sq = 1.0 if inv_snorm else 0.0
    h_sq = 1.0 if inv_h else 0.0
    aux_sq = u_sq + rho * rho * h_sq + 2.0 * rho * u_dot_hhat
    info = {
        "sats_norm": ns,
        "vr_norm": nv,
        "hid_norm": nh,
        "cos_sats_vr": cos_sv,
        "s_norm": s_norm,
        "cos_u_hid": u_dot_hhat,
        "aux_norm": math.sqrt(max(aux_sq, 0.0)),
        "rho": rho,
    }
    # g_aux = (ĝ_S + ĝ_V)/‖s‖ + ρ ĝ_H, written on the raw gradients
    coefs = {S: inv_s * inv_snorm, R: inv_v * inv_snorm, H: rho * inv_h}
    return _lincomb(coefs, lists, flat, n), info


def combine_one_one_one(
    g_tok: GradLike, g_sats: GradLike | None, g_other: GradLike | None, *, sync: bool | None = None, group=None
) -> tuple[GradLike, dict[str, float]]:
    """The "1:1:1" variant of 003 Table 4: ``g = g_tok + ‖g_tok‖·ĝ_SATS + ‖g_tok‖·ĝ_other`` (SPEC B.6).

    ``g_other`` is the VR or hidden-state gradient. Unit vectors follow the same ĝ := 0 convention; ‖g_tok‖ = 0
    gives g = 0. Returns ``(g, info)`` with the three norms and the coefficients.
    """
    lists, flat, n = _gather_terms(g_tok=g_tok, g_sats=g_sats, g_other=g_other)
    if lists["g_tok"] is None:
        raise ValueError("g_tok is required (it sets the scale of the update); got None")
    tt, ss, oo = _reduced_products(
        lists, [("g_tok", "g_tok"), ("g_sats", "g_sats"), ("g_other", "g_other")], sync, group
    )
    nt, ns, no = (math.sqrt(max(x, 0.0)) for x in (tt, ss, oo))
    info = {"tok_norm": nt, "sats_norm": ns, "other_norm": no}
    if nt == 0.0:
        info.update(sats_coef=0.0, other_coef=0.0)
        return _zeros_like_form(lists, flat, n, "g_tok"), info
    cs = nt / ns if ns >= ZERO_NORM else 0.0
    co = nt / no if no >= ZERO_NORM else 0.0
    info.update(sats_coef=cs, other_coef=co)
    return _lincomb({"g_tok": 1.0, "g_sats": cs, "g_other": co}, lists, flat, n), info
