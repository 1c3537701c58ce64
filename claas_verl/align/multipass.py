"""Per-term gradients over the step's micro-batches, balanced into ``param.grad`` (docs/math.md §B.6-B.7).

Usable from any training loop::

    optimizer.zero_grad(set_to_none=True)
    metrics = balanced_backward(
        model, micro_batches, weights=microbatch_weights([mb["n_resp"] for mb in micro_batches]),
        forward=lambda model, mb: model(**mb["inputs"], output_hidden_states=True),
        losses={"tok": tok_loss, "sats": sats_loss, "vr": vr_loss, "hid": hid_loss},   # any subset with "tok"
        ratio=1.0, rho=2.0,
    )
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
    optimizer.step()

Each loss closure is ``fn(out, mb) -> scalar`` where ``out = forward(model, mb)``: closures never run the model
themselves, which is what lets one forward serve every term.

Two schedules give the same gradients (tested):

- ``single_forward=True`` (default): per micro-batch, one forward; then one ``backward(retain_graph=True)`` per
  term on the same graph, moving ``.grad`` into that term's accumulator after each. Costs one forward per
  micro-batch instead of one per term, but keeps the forward graph (activations of every term's inputs) alive
  until the micro-batch's last backward.
- ``single_forward=False``: the separate-pass variant of the MOPD paper (one forward + backward per term and
micro-batch).
  Use it when the retained graph does not fit, or with wrappers that do not support several backward passes per
  forward (FSDP2 reshards parameters after backward unless ``reshard_after_forward=False``; DDP needs
  ``no_sync()`` around all but the last backward).

It is also the reference of the MOPD actor's own balanced step (``MOPDTrainingWorker.balanced_engine_step``,
whose token pass must be verl's engine pass, so it cannot call this function):
``tests/mopd/trainer/test_mopd_balanced_step.py`` checks that step's gradient against ``balanced_backward`` on the
same micro-batches of a tiny model (and the step under FSDP2 against the unsharded one). A change to either must
keep the two equal.

Per-term gradient accumulators hold one gradient copy per term (up to 4 on top of the model); on FSDP they are
sharded like ``param.grad``. The combination is :func:`claas_verl.align.balance.balance_fsar` (eq. 10 then eq. 9 in
one read of each gradient, written over the token accumulator), or ``combine_one_one_one`` (``variant="1:1:1"``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from claas_verl.align.balance import balance_fsar, combine_one_one_one, grad_norm

TERMS = ("tok", "sats", "vr", "hid")
VARIANTS = ("fsar", "1:1:1")


def microbatch_weights(n_resp: Sequence[int]) -> list[float]:
    """B.7 weights ``n_resp(mb) / n_resp_total`` (= verl's ``loss_scale_factor`` per micro-batch)."""
    total = sum(int(x) for x in n_resp)
    if total <= 0 or any(int(x) < 0 for x in n_resp):
        raise ValueError(f"n_resp must be non-negative response counts with a positive sum; got {list(n_resp)}")
    return [int(x) / total for x in n_resp]


def _validate(losses: Mapping[str, Callable], micro_batches: Sequence, weights: Sequence[float], variant: str):
    unknown = set(losses) - set(TERMS)
    if unknown:
        raise ValueError(f"losses has unknown terms {sorted(unknown)}; allowed: {TERMS}")
    if "tok" not in losses:
        raise ValueError("losses must contain 'tok': the token gradient sets the scale of the balanced update")
    if len(weights) != len(micro_batches) or not micro_batches:
        raise ValueError(
            f"weights must give one weight per micro-batch (B.7: n_resp(mb)/n_resp_total); got {len(weights)} weights "
            f"for {len(micro_batches)} micro-batches"
        )
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    if variant == "1:1:1":
        others = [t for t in ("vr", "hid") if t in losses]
        if "sats" not in losses or len(others) != 1:
            raise ValueError("variant='1:1:1' needs exactly 'tok', 'sats' and one of 'vr'/'hid' (MOPD paper Table 4)")


def _stash(params: list[torch.nn.Parameter], acc: list) -> None:
    """Move every ``p.grad`` into ``acc`` (adding) and clear it, so the next backward starts from zero."""
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        acc[i] = g if acc[i] is None else acc[i].add_(g)
        p.grad = None


def _carried_backward(model, micro_batches, weights, forward, losses, params, multipliers) -> dict[str, float]:
    """The carried approximation: per micro-batch one forward and ONE backward of ``Σ_t α_t·w·ℓ_t`` (the
    multipliers ``α`` of an earlier exact step), so ``.grad`` holds ``Σ_t α_t·g_t`` with no per-term gradient."""
    missing = [t for t in losses if f"mult_{t}" not in multipliers]
    if missing:
        raise ValueError(f"multipliers lack {['mult_' + t for t in missing]}: take them from the metrics of an exact "
                         "balanced step with the same terms")
    values = {t: 0.0 for t in losses}
    for mb, w in zip(micro_batches, weights):
        out = forward(model, mb)
        parts = {t: losses[t](out, mb) for t in losses}
        total = sum(float(multipliers[f"mult_{t}"]) * w * parts[t] for t in parts)
        total.backward()
        for t, v in parts.items():
            values[t] += w * float(v.detach())
        del out, parts, total
    return values


def _run_terms(model, micro_batches, weights, forward, losses, params, single_forward) -> dict[str, list]:
    terms = [t for t in TERMS if t in losses]
    acc = {t: [None] * len(params) for t in terms}
    if single_forward:
        for mb, w in zip(micro_batches, weights):
            out = forward(model, mb)
            for j, t in enumerate(terms):
                loss = losses[t](out, mb) * w
                loss.backward(retain_graph=j < len(terms) - 1)
                _stash(params, acc[t])
            del out
    else:
        for t in terms:
            for mb, w in zip(micro_batches, weights):
                (losses[t](forward(model, mb), mb) * w).backward()
            _stash(params, acc[t])  # .grad already holds Σ_mb w·∇ℓ_t(mb)
    return acc


def balanced_backward(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    weights: Sequence[float],
    forward: Callable[[torch.nn.Module, Any], Any],
    losses: Mapping[str, Callable[[Any, Any], torch.Tensor]],
    *,
    ratio: float = 1.0,
    rho: float = 2.0,
    variant: str = "fsar",
    single_forward: bool = True,
    multipliers: Mapping[str, float] | None = None,
    sync: bool | None = None,
    group=None,
) -> dict[str, float]:
    """Write the balanced step gradient into ``param.grad`` of every trainable parameter (docs/math.md §B.6-B.7).

    For each term, ``g_term = Σ_mb weight(mb)·∇ℓ_term(mb)`` (B.7); then ``g = balance(g_tok, combine_aux(...))``
    (eqs. 9-10), or ``g = g_tok`` when only ``"tok"`` is given (new-domain steps: no balancing). Existing
    ``.grad`` values are discarded first. Clipping and the optimizer step are the caller's.

    Args:
        model: the student; its parameters with ``requires_grad`` receive the result.
        micro_batches: the step's micro-batches (opaque objects handed to ``forward`` and the closures).
        weights: one weight per micro-batch, ``n_resp(mb)/n_resp_total`` (:func:`microbatch_weights`).
        forward: ``forward(model, mb) -> out``, shared by every term.
        losses: ``{"tok": fn, "sats": fn, "vr": fn, "hid": fn}`` (any subset containing ``"tok"``), each
            ``fn(out, mb) -> 0-d tensor`` = the micro-batch loss ℓ_term(mb) of B.2-B.5.
        ratio, rho: r of eq. (9) and ρ of eq. (10).
        variant: ``"fsar"`` (eq. 10 then eq. 9) or ``"1:1:1"`` (MOPD paper Table 4).
        single_forward: one forward per micro-batch serving every term (default), else separate passes.
        multipliers: the carried approximation (:mod:`claas_verl.align.carried`): ``{"mult_tok": α_tok,
            "mult_sats": ...}`` from the metrics of an earlier exact step; one backward of ``Σ_t α_t·ℓ_t`` per
            micro-batch replaces the per-term backward passes and the balancing. ``None``: exact.
        sync, group: cross-rank reduction of norms and inner products (see :mod:`claas_verl.align.balance`).

    Returns:
        Metrics: ``{term}_grad_norm`` for each term, and with aux terms ``aux_grad_norm``, ``cos_tok_aux``,
        ``cos_sats_vr``, ``cos_u_hid``, ``s_norm``, ``balance_scale`` (c), ``final_grad_norm``; always
        ``mult_{term}``, the multiplier of each raw term gradient in g (``g = Σ_t mult_t·g_t``). A carried step
        returns ``{term}_loss``, its multipliers and ``balance_carried = 1``.
    """
    _validate(losses, micro_batches, weights, variant)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameters with requires_grad=True")
    for p in params:
        p.grad = None
    if multipliers is not None:
        values = _carried_backward(model, micro_batches, weights, forward, losses, params, multipliers)
        return {**{f"{t}_loss": v for t, v in values.items()},
                **{f"mult_{t}": float(multipliers[f"mult_{t}"]) for t in losses}, "balance_carried": 1.0}
    acc = _run_terms(model, micro_batches, weights, forward, losses, params, single_forward)

    metrics: dict[str, float] = {}
    aux_terms = [t for t in ("sats", "vr", "hid") if t in acc]
    if not aux_terms:
        g = acc["tok"]
        metrics["tok_grad_norm"] = grad_norm(g, sync=sync, group=group)
        metrics["final_grad_norm"] = metrics["tok_grad_norm"]
        metrics["mult_tok"] = 1.0
    elif variant == "1:1:1":
        other = "vr" if "vr" in acc else "hid"
        g, info = combine_one_one_one(acc["tok"], acc["sats"], acc[other], sync=sync, group=group)
        metrics.update(
            tok_grad_norm=info["tok_norm"],
            sats_grad_norm=info["sats_norm"],
            **{f"{other}_grad_norm": info["other_norm"]},
        )
        metrics["final_grad_norm"] = grad_norm(g, sync=sync, group=group)
        metrics.update({"mult_tok": 1.0 if info["tok_norm"] > 0 else 0.0, "mult_sats": info["sats_coef"],
                        f"mult_{other}": info["other_coef"]})
    else:
        # eqs. (10) then (9) from the Gram matrix of the four gradients, written over the token accumulator (ours)
        g, info = balance_fsar(acc["tok"], acc.get("sats"), acc.get("vr"), acc.get("hid"), ratio, rho,
                               in_place=True, sync=sync, group=group)
        for t in aux_terms:
            metrics[f"{t}_grad_norm"] = info[f"{t}_norm"]
        metrics.update(
            tok_grad_norm=info["tok_norm"],
            aux_grad_norm=info["aux_norm"],
            cos_tok_aux=info["cos_tok_aux"],
            cos_sats_vr=info["cos_sats_vr"],
            cos_u_hid=info["cos_u_hid"],
            s_norm=info["s_norm"],
            balance_scale=info["scale"],
            final_grad_norm=info["final_norm"],
            balance_fallback=info["fallback"],
            tok_coef=info["tok_coef"],  # a and b·c of eq. (9): the two parts' norms are a·‖g_tok‖, b·c·‖g_aux‖
            aux_coef=info["aux_coef"],
        )
        # g = Σ_t mult_t·g_t: the multiplier of each raw gradient (what the carried approximation reuses)
        metrics.update({f"mult_{t}": info[f"mult_{t}"] for t in ("tok", *aux_terms)})
    for p, gi in zip(params, g):
        p.grad = gi
    return metrics
