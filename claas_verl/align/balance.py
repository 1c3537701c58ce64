"""Gradient-norm balancing of the token and alignment gradients (docs/math.md §B.6, MOPD paper eqs. 9-10).

A gradient is either one flat tensor or a list of per-parameter tensors (``None`` = no gradient for that
parameter, read as zeros). Every function returns its combination in the same form as its inputs.

Distributed reduction. Norms and inner products are sums of per-element products, so each rank computes its
local partial sums and one ``all_reduce(SUM)`` over ``group`` completes them (docs/math.md §B.6: reduced over all shards
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

# docs/math.md §B.6 [CHOICE]: a gradient with norm below this is "zero" (ĝ := 0; eq. 9 falls back to g = g_tok).
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
    """Combine token and auxiliary gradients at target norm ratio ``r`` (docs/math.md §B.6, MOPD paper eq. 9, unified
    form).

    ``g = min(1, r)·g_tok + min(1, 1/r)·‖g_tok‖·ĝ_aux``, so ‖token part‖ / ‖aux part‖ = r, and
    ``‖g‖² = ‖g_tok‖²·(a² + b² + 2ab·cos φ)`` with ``a = min(1, r)``, ``b = min(1, 1/r)``, φ = ∠(g_tok, g_aux).

    Edge cases ``[CHOICE]``: ‖g_tok‖ = 0 gives g = 0; otherwise ‖g_aux‖ < 1e-30 (or ``g_aux is None``) gives
    g = g_tok (also for r < 1: no aux direction means nothing to balance against).

    Args:
        g_tok, g_aux: flat tensors, or lists of per-parameter tensors (None entries allowed), in the same form.
        ratio: r > 0 (MOPD paper default 1).
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
    """FSAR auxiliary direction ``g_aux = u + ρ·ĝ_hid``, ``u = s/‖s‖``, ``s = ĝ_SATS + ĝ_VR`` (docs/math.md §B.6, eq.
    10).

    Unit-vector convention ``[CHOICE]``: ĝ := 0 when ‖g‖ < 1e-30 (each term separately, and u := 0 when ‖s‖ is),
    so a step without any region gives g_aux = ρ·ĝ_hid, never NaN. A term passed as ``None`` is treated as zero,
    which also covers the two-term variants (e.g. Replay-KL + SATS: ``combine_aux(g_sats, None, None)``).
    ‖s‖ = √(2 + 2cos(g_SATS, g_VR)) and ‖g_aux‖ = √(1 + ρ² + 2ρ·cos(u, g_hid)) when all are non-zero.

    Returns:
        ``(g_aux, info)`` with ``sats_norm``, ``vr_norm``, ``hid_norm``, ``cos_sats_vr``, ``s_norm``,
        ``cos_u_hid``, ``aux_norm`` (= ‖g_aux‖) and ``{sats,vr,hid}_coef``, the multipliers of the raw gradients
        in g_aux. Pass g_aux on to :func:`balance`; only its direction matters.
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
    info.update(sats_coef=coefs[S], vr_coef=coefs[R], hid_coef=coefs[H])  # multipliers of the raw gradients
    return _lincomb(coefs, lists, flat, n), info


def _gram(lists: dict, names: Sequence[str], length: int, sync: bool | None, group) -> dict[tuple[str, str], float]:
    """Every inner product of the named gradients, reading each gradient ONCE: per parameter entry, the rows of the
    present terms are stacked and multiplied by their transpose (partials in ≥ fp32, accumulated in fp64); one
    all-reduce of the whole matrix. A term passed as None, or a None entry, contributes zeros."""
    device = _device_of(lists)
    k = len(names)
    G = torch.zeros(k, k, dtype=torch.float64, device=device)
    for i in range(length):
        idx = [j for j, n in enumerate(names) if lists[n] is not None and lists[n][i] is not None]
        if not idx:
            continue
        rows = [_local(lists[names[j]][i]) for j in idx]
        dt = torch.float64 if any(r.dtype == torch.float64 for r in rows) else torch.float32
        X = torch.stack([r.reshape(-1).to(dt) for r in rows])
        sel = torch.tensor(idx, device=device)
        G[sel[:, None], sel] += (X @ X.T).to(torch.float64)
    if _do_sync(sync):
        torch.distributed.all_reduce(G, op=torch.distributed.ReduceOp.SUM, group=group)
    vals = G.cpu().tolist()
    return {(a, b): vals[i][j] for i, a in enumerate(names) for j, b in enumerate(names)}


def balance_fsar(
    g_tok: GradLike,
    g_sats: GradLike | None,
    g_vr: GradLike | None,
    g_hid: GradLike | None,
    ratio: float = 1.0,
    rho: float = 2.0,
    *,
    in_place: bool = False,
    sync: bool | None = None,
    group=None,
) -> tuple[GradLike, dict[str, float]]:
    """``balance(g_tok, combine_aux(g_sats, g_vr, g_hid, ρ), r)`` in one read of each gradient and one write.

    The same equations and zero-norm conventions as :func:`combine_aux` then :func:`balance` (whose ``info`` keys
    it returns, plus ``mult_{tok,sats,vr,hid}``: g = Σ_t mult_t·g_t). Norms, cosines and ‖g_aux‖ come from the
    Gram matrix of the four gradients (:func:`_gram`), so g_aux is never built; g is written over ``g_tok`` when
    ``in_place`` (the caller owns it). Equal to the two-step form up to the order of the floating-point additions
    (``tests/align/test_balance.py``).
    """
    r = _check_ratio(ratio, "ratio")
    rho = float(rho)
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"rho must be a finite number >= 0; got {rho!r}")
    lists, flat, n = _gather_terms(g_tok=g_tok, g_sats=g_sats, g_vr=g_vr, g_hid=g_hid)
    if lists["g_tok"] is None:
        raise ValueError("g_tok is required (it sets the scale of the update); got None")
    T, S, R, H = "g_tok", "g_sats", "g_vr", "g_hid"
    P = _gram(lists, (T, S, R, H), n, sync, group)
    ns, nv, nh = (math.sqrt(max(P[x, x], 0.0)) for x in (S, R, H))
    inv_s, inv_v, inv_h = (1.0 / x if x >= ZERO_NORM else 0.0 for x in (ns, nv, nh))
    cos_sv = P[S, R] * inv_s * inv_v
    s_norm = math.sqrt(max((1.0 if inv_s else 0.0) + (1.0 if inv_v else 0.0) + 2.0 * cos_sv, 0.0))
    inv_snorm = 1.0 / s_norm if s_norm >= ZERO_NORM else 0.0
    coef = {S: inv_s * inv_snorm, R: inv_v * inv_snorm, H: rho * inv_h}  # g_aux = Σ coef_t·g_t (eq. 10)
    aux_sq = sum(coef[a] * coef[b] * P[a, b] for a in coef for b in coef)
    tok_norm, aux_norm = math.sqrt(max(P[T, T], 0.0)), math.sqrt(max(aux_sq, 0.0))
    ta = sum(coef[a] * P[T, a] for a in coef)
    info = {"sats_norm": ns, "vr_norm": nv, "hid_norm": nh, "cos_sats_vr": cos_sv, "s_norm": s_norm,
            "cos_u_hid": (P[S, H] * inv_s + P[R, H] * inv_v) * inv_h * inv_snorm, "rho": rho, "tok_norm": tok_norm,
            "aux_norm": aux_norm, "ratio": r,
            "cos_tok_aux": ta / (tok_norm * aux_norm) if tok_norm > 0 and aux_norm >= ZERO_NORM else 0.0}
    if tok_norm == 0.0:
        a, bc, c, fb, final = 0.0, 0.0, 0.0, 2.0, 0.0
    elif aux_norm < ZERO_NORM:
        a, bc, c, fb, final = 1.0, 0.0, 0.0, 1.0, tok_norm
    else:
        a, b = min(1.0, r), min(1.0, 1.0 / r)
        c = tok_norm / aux_norm
        bc, fb = b * c, 0.0
        final = tok_norm * math.sqrt(max(a * a + b * b + 2 * a * b * info["cos_tok_aux"], 0.0))
    mults = {"tok": a, "sats": bc * coef[S], "vr": bc * coef[R], "hid": bc * coef[H]}
    info.update(scale=c, tok_coef=a, aux_coef=bc, final_norm=final, fallback=fb,
                **{f"mult_{t}": v for t, v in mults.items()})
    if tok_norm == 0.0:
        return _zeros_like_form(lists, flat, n, T), info
    out = []
    with torch.no_grad():
        for i in range(n):
            acc = lists[T][i]
            if acc is not None:
                acc = acc.mul_(a) if in_place else acc * a
            for name, t in ((S, "sats"), (R, "vr"), (H, "hid")):
                x = None if lists[name] is None else lists[name][i]
                if x is None or mults[t] == 0.0:
                    continue
                acc = x * mults[t] if acc is None else acc.add_(x, alpha=mults[t])
            if acc is None:
                present = [lists[m][i] for m in (S, R, H) if lists[m] is not None and lists[m][i] is not None]
                acc = torch.zeros_like(present[0]) if present else None
            out.append(acc)
    return (out[0] if flat else out), info


def combine_one_one_one(
    g_tok: GradLike, g_sats: GradLike | None, g_other: GradLike | None, *, sync: bool | None = None, group=None
) -> tuple[GradLike, dict[str, float]]:
    """The "1:1:1" variant of the MOPD paper Table 4: ``g = g_tok + ‖g_tok‖·ĝ_SATS + ‖g_tok‖·ĝ_other`` (docs/math.md
    §B.6).

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


# ----------------------------------------------------------------------------------------------------------------
# the same combinations streamed over separate backward passes, with one gradient on the device


def _grad_locals(params) -> list:
    return [None if p.grad is None else _local(p.grad) for p in params]


def _to_host(x: torch.Tensor, scale: float | None = None, buffers: dict | None = None, key=None) -> torch.Tensor:
    """A host copy of ``x`` (pinned when ``x`` is on CUDA). With ``buffers``, the host tensor stored under ``key``
    is reused when its shape and dtype match (pinned allocation costs about a second per GB: once, not per step)."""
    out = None if buffers is None else buffers.get(key)
    if out is None or out.shape != x.shape or out.dtype != x.dtype:
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
        if buffers is not None:
            buffers[key] = out
    out.copy_(x)
    return out if scale is None else out.mul_(scale)


class HostBalancer:
    """Eqs. (9)-(10) (or the "1:1:1" variant) over separate backward passes, keeping ONE gradient on the device.

    docs/math.md §B.6: "the SATS pass and the VR pass give u (kept on host), then the hidden pass gives ĝ_hid". The
    token gradient and the pooled direction ``s = ĝ_SATS + ĝ_VR`` live on the host (one fp32 copy each, pinned on CUDA);
    every norm and inner product is accumulated pass by pass (local partial sums, one ``all_reduce`` per pass, see the
    module docstring), so the device holds only the gradient of the pass in flight, plus one parameter's host copy at a
    time. The last pass (the hidden term, or the "other" term of 1:1:1) stays in ``.grad`` and the final ``g`` is
    written over it in place:

        g = α_T·g_tok + α_U·s + α_L·g_last

    which is exactly ``balance(g_tok, combine_aux(g_sats, g_vr, g_hid, ρ), r)`` (or ``combine_one_one_one``) with the
    same zero-norm conventions. Usage per step, with ``params`` the trainable parameters::

        hb = HostBalancer(params, variant="fsar", ratio=r, rho=ρ)
        <token pass>;  hb.take_token()
        <SATS pass>;   hb.take_pooled("sats")
        <VR pass>;     hb.take_pooled("vr")
        <hidden pass>; info = hb.finish("hid")      # .grad now holds g

    ``take_*`` clear ``.grad`` after reading it. Device memory beyond the one ``.grad`` vector: one parameter's
    host copy at a time. Host memory: two gradient vectors (g_tok and s); pass the same ``buffers`` dict every step
    to reuse them (the caller owns it; its tensors are overwritten by the next step).
    """

    def __init__(self, params, *, variant: str = "fsar", ratio: float = 1.0, rho: float = 2.0,
                 sync: bool | None = None, group=None, buffers: dict | None = None):
        if variant not in ("fsar", "1:1:1"):
            raise ValueError(f"variant must be 'fsar' or '1:1:1', got {variant!r}")
        self.params = list(params)
        self.variant, self.ratio, self.sync, self.group = variant, _check_ratio(ratio, "ratio"), sync, group
        self.rho = float(rho)
        if not (math.isfinite(self.rho) and self.rho >= 0):
            raise ValueError(f"rho must be a finite number >= 0; got {rho!r}")
        self.T: list | None = None
        self.U: list | None = None
        self.tt = self.uu = self.tu = 0.0
        self.norms: dict[str, float] = {}
        self.cos_pooled = 0.0
        self.pooled: list[str] = []
        self.buffers = buffers

    # ---------------------------------------------------------------- passes
    def _device(self) -> torch.device:
        for p in self.params:
            return _local(p).device
        return torch.device("cpu")

    def _products(self, G: list, with_host: bool) -> list[float]:
        """[<G,G>, <T,G>, <U,G>] over local shards (host copies moved one parameter at a time), one all-reduce."""
        dev = self._device()
        acc = torch.zeros(3, dtype=torch.float64, device=dev)
        for i, g in enumerate(G):
            if g is None:
                continue
            gg = g.to(_acc_dtype(g)).reshape(-1)
            acc[0] += torch.dot(gg, gg).to(torch.float64)  # dot: no temporary of the parameter's size
            if with_host:
                for j, H in ((1, self.T), (2, self.U)):
                    if H is not None and H[i] is not None:
                        acc[j] += torch.dot(gg, H[i].to(dev, non_blocking=True).to(gg.dtype).reshape(-1)).to(
                            torch.float64)
        if _do_sync(self.sync):
            torch.distributed.all_reduce(acc, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return [float(v) for v in acc.cpu()]

    def _clear(self):
        for p in self.params:
            p.grad = None

    def take_token(self) -> float:
        """g_tok (in ``.grad``) -> host; returns ‖g_tok‖."""
        if self.T is not None:
            raise ValueError("take_token called twice in one step")
        G = _grad_locals(self.params)
        self.tt = self._products(G, with_host=False)[0]
        self.T = [None if g is None else _to_host(g, None, self.buffers, ("tok", i)) for i, g in enumerate(G)]
        self._clear()
        self.norms["tok"] = math.sqrt(max(self.tt, 0.0))
        return self.norms["tok"]

    def take_pooled(self, name: str) -> float:
        """ĝ_name (from ``.grad``) added to the host direction s (ĝ := 0 below 1e-30); returns ‖g_name‖."""
        if self.T is None:
            raise ValueError("take_token must come first: g_tok sets the scale of the update")
        if self.variant == "1:1:1" and self.pooled:
            raise ValueError("the 1:1:1 variant has one pooled term (SATS); pass the other one to finish()")
        G = _grad_locals(self.params)
        gg, tg, ug = self._products(G, with_host=True)
        n = math.sqrt(max(gg, 0.0))
        self.norms[name] = n
        if n >= ZERO_NORM:
            inv = 1.0 / n
            if self.pooled:  # cos between the direction so far and this term (cos(SATS, VR) for two terms)
                self.cos_pooled = ug * inv / math.sqrt(self.uu) if self.uu > 0 else 0.0
            self.uu += 2.0 * inv * ug + inv * inv * gg
            self.tu += inv * tg
            if self.U is None:
                self.U = [None] * len(G)
            for i, g in enumerate(G):
                if g is None:
                    continue
                if self.U[i] is None:
                    self.U[i] = _to_host(g, inv, self.buffers, ("s", i))
                else:
                    self.U[i].add_(g.to("cpu"), alpha=inv)
        self.pooled.append(name)
        self._clear()
        return n

    def finish(self, last: str | None = None) -> dict[str, float]:
        """Combine; with ``last`` the gradient in ``.grad`` is that term's (used in place). Writes g into ``.grad``."""
        if self.T is None:
            raise ValueError("take_token must come first")
        L = _grad_locals(self.params) if last is not None else [None] * len(self.params)
        ll, tl, ul = self._products(L, with_host=True) if last is not None else (0.0, 0.0, 0.0)
        nl = math.sqrt(max(ll, 0.0))
        if last is not None:
            self.norms[last] = nl
        inv_l = 1.0 / nl if nl >= ZERO_NORM else 0.0
        nt = self.norms["tok"]
        info = {"tok_norm": nt, "ratio": self.ratio, "rho": self.rho}
        if self.variant == "fsar":
            s_norm = math.sqrt(max(self.uu, 0.0))
            inv_s = 1.0 / s_norm if s_norm >= ZERO_NORM else 0.0
            # g_aux = inv_s·s + ρ·inv_l·g_last
            cu, cl = inv_s, self.rho * inv_l
            aux_sq = cu * cu * self.uu + cl * cl * ll + 2 * cu * cl * ul
            tok_aux = cu * self.tu + cl * tl
            aux_norm = math.sqrt(max(aux_sq, 0.0))
            info.update(s_norm=s_norm, cos_u_hid=inv_s * inv_l * ul, cos_sats_vr=self.cos_pooled, aux_norm=aux_norm,
                        cos_tok_aux=tok_aux / (nt * aux_norm) if nt > 0 and aux_norm >= ZERO_NORM else 0.0)
            if nt == 0.0:
                a_t, a_u, a_l, fb, c, a, bc = 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0
            elif aux_norm < ZERO_NORM:
                a_t, a_u, a_l, fb, c, a, bc = 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0
            else:
                a, b = min(1.0, self.ratio), min(1.0, 1.0 / self.ratio)
                c = nt / aux_norm
                bc = b * c
                a_t, a_u, a_l, fb = a, bc * cu, bc * cl, 0.0
            info.update(scale=c, tok_coef=a, aux_coef=bc, fallback=fb)
        else:  # 1:1:1: U holds ĝ_SATS (unit, or absent), g_last is the other term
            if nt == 0.0:
                a_t = a_u = a_l = 0.0
            else:
                a_t, a_u, a_l = 1.0, (nt if self.U is not None else 0.0), nt * inv_l
            info.update(sats_coef=a_u, other_coef=a_l, other_norm=nl)
        final_sq = (a_t * a_t * self.tt + a_u * a_u * self.uu + a_l * a_l * ll
                    + 2 * a_t * a_u * self.tu + 2 * a_t * a_l * tl + 2 * a_u * a_l * ul)
        info["final_norm"] = math.sqrt(max(final_sq, 0.0))
        for name in ("sats", "vr", "hid"):
            info[f"{name}_norm"] = self.norms.get(name, 0.0)
        # g as multipliers of the raw per-term gradients (s holds each pooled term divided by its norm): what the
        # carried approximation (claas_verl.align.carried) reuses on the next steps
        info["mult_tok"] = a_t
        for name in self.pooled:
            n = self.norms[name]
            info[f"mult_{name}"] = a_u / n if n >= ZERO_NORM else 0.0
        if last is not None:
            info[f"mult_{last}"] = a_l
        self._write(L, a_t, a_u, a_l)
        self.T = self.U = None
        return info

    @torch.no_grad()
    def _write(self, L: list, a_t: float, a_u: float, a_l: float):
        dev = self._device()
        for i, p in enumerate(self.params):
            t = self.T[i] if a_t != 0.0 else None
            u = self.U[i] if self.U is not None and a_u != 0.0 else None
            if L[i] is None:
                if t is None and u is None:  # no term reaches this parameter (or g = 0: zeros where g_tok is)
                    p.grad = None if self.T[i] is None else torch.zeros_like(p)
                    continue
                p.grad = torch.zeros_like(p)  # a DTensor with the parameter's placements under FSDP2
                out = _local(p.grad)
            else:
                out = L[i].mul_(a_l)
            if t is not None:
                out.add_(t.to(dev, non_blocking=True).to(out.dtype), alpha=a_t)
            if u is not None:
                out.add_(u.to(dev, non_blocking=True).to(out.dtype), alpha=a_u)
