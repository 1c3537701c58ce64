"""The passes of the MOPD actor's balanced replay step (docs/math.md §B.6/B.7), used by
:meth:`claas_verl.mopd.trainer.workers.MOPDTrainingWorker.balanced_engine_step`.

Two schedules (``mopd.signal.passes``): :func:`shared_step` (one student forward per micro-batch for the token loss
and every alignment term, one backward per term on it: the floor) and the separate passes (verl's token pass, then
:func:`alignment_pass` per term, one gradient on the device); :func:`carried_pass` is carried balancing's single
alignment backward. Also the row groups of verl's micro-batches (:func:`update_row_groups`), the padded alignment
micro-batches, FSDP2's gathered-weights context and the step's metric names.
"""

from __future__ import annotations

import contextlib

import torch
from verl.utils import tensordict_utils as tu

from claas_verl.align import (
    AlignmentSignals,
    PooledRows,
    TeacherTargetStore,
    alignment_losses,
    alignment_signals,
    attention_modules,
    balanced_backward,
    microbatch_weights,
)
from claas_verl.mopd.trainer import alignment
from claas_verl.verl_ext.engine_device import compute_device, engine_autocast


def pass_order(cfg: alignment.AuxConfig) -> tuple[tuple[str, ...], str | None]:
    """(terms whose unit directions go to the host, term left in ``.grad`` for the final combination)."""
    if cfg.combine == "1:1:1":
        return ("sats",), cfg.terms[1]
    last = "hidden" if "hidden" in cfg.terms else None
    return tuple(t for t in cfg.terms if t != last), last


UPDATE_PARTITION_KEYS = ("use_dynamic_bsz", "max_token_len_per_gpu", "micro_batch_size_per_gpu")


def update_row_groups(data, dp_group=None, settings: dict | None = None) -> list[list[int]]:
    """The row indices of each micro-batch verl's ``forward_backward_batch`` will run for ``data``.

    Calls verl's own ``prepare_micro_batches`` (same arguments as the engine) on the rows' ids only.
    ``settings`` overrides the batch's non-tensor partition keys (:data:`UPDATE_PARTITION_KEYS`): the teacher
    forward passes the actor's, so the targets are computed on the update's micro-batches.
    """
    from verl.workers.engine.utils import prepare_micro_batches

    ids = data["input_ids"]
    light = tu.get_tensordict({"input_ids": ids})
    for key in (*UPDATE_PARTITION_KEYS, "force_group_size"):
        value = (settings or {}).get(key, tu.get_non_tensor_data(data=data, key=key, default=None))
        if value is not None:
            tu.assign_non_tensor(light, **{key: value})
    tu.assign_non_tensor(light, sp_size=1)
    micro, indices = prepare_micro_batches(data=light, dp_group=dp_group, same_micro_num_in_dp=True)
    if indices is not None:
        return [[int(i) for i in g] for g in indices]
    out, lo = [], 0
    for mb in micro:
        n = len(mb)
        out.append(list(range(lo, lo + n)))
        lo += n
    return out


def dp_group(engine):
    get = getattr(engine, "get_data_parallel_group", None)
    return get() if get is not None else None


def sequences(data) -> list[torch.Tensor]:
    ids = data["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise ValueError("the balanced MOPD update needs verl's no-padding batch layout (nested input_ids)")
    values, offsets = ids.values(), ids.offsets()
    return [values[int(offsets[i]):int(offsets[i + 1])] for i in range(offsets.numel() - 1)]


def micro_batches(data, groups: list[list[int]]) -> list[alignment.AuxMicroBatch]:
    for key in (alignment.REGION_IDS, alignment.WINDOW):
        if key not in data.keys():
            raise ValueError(f"field {key!r} missing: the driver stores the step regions before the teacher forward")
    mask = data["response_mask"]
    if getattr(mask, "is_nested", False):
        resp = mask.offsets().diff()
    else:
        resp = mask.new_full((mask.shape[0],), mask.shape[1])
    rid = data[alignment.REGION_IDS]
    win = data[alignment.WINDOW]
    rid = rid.to_padded_tensor(-1) if getattr(rid, "is_nested", False) else rid
    win = win.to_padded_tensor(0) if getattr(win, "is_nested", False) else win
    return alignment.aux_micro_batches(sequences(data), rid, win, resp, groups)


@contextlib.contextmanager
def params_gathered_through_backward(engine, several: bool = False):
    """FSDP2 without gradient checkpointing: keep every layer gathered from the forward to the backward of an
    alignment pass.

    The alignment losses tap q/k/v inside decoder layers; their gradient reaches ``q_proj`` etc. without flowing
    through the layer's output, where FSDP2's pre-backward hook would re-gather a layer resharded after its
    forward, so a backward on the forward's saved weights fails on freed parameter storage. A checkpointed layer
    saves no weights: its backward recomputes the layer through FSDP2's pre-forward hook, which gathers it
    again, so there the layers reshard as usual (keeping them gathered costs 2 bytes per parameter, about
    12 GiB at 8B). Restored to the engine's setting afterwards (FSDP2 keeps the root module unsharded after
    forward).
    """
    from torch.distributed.fsdp import FSDPModule

    module = engine.module
    if not isinstance(module, FSDPModule) or getattr(module, "is_gradient_checkpointing", False):
        yield
        return
    module.set_reshard_after_forward(False)
    if several:  # several backward passes on one forward's graph: the first must not free the gathered weights
        module.set_reshard_after_backward(False)
    try:
        yield
    finally:
        cfg = getattr(engine, "engine_config", None)
        if several:
            module.set_reshard_after_backward(True)
        module.set_reshard_after_forward(bool(getattr(cfg, "reshard_after_forward", True)))
        module.set_reshard_after_forward(False, recurse=False)
        # after several backward passes the layers are still gathered too (their .grad is on the sharded
        # parameters, which the module registers again only once resharded)
        for sub in module.modules() if several else (module,):
            if isinstance(sub, FSDPModule):
                sub.reshard()


def reduction(params) -> tuple[bool, object]:
    """(sync, group) for claas_verl.align.balance: FSDP2 DTensor grads reduce over their shard group."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch >= 2.4 has it
        DTensor = ()
    for p in params:
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return True, mesh.get_group(mesh.ndim - 1)  # HSDP (replicate, shard): the shard dim is last
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("the balanced MOPD update needs FSDP2 (actor.strategy=fsdp2): sharded plain gradients "
                         "would be normed per rank")
    return False, None


def targets_to(sig: AlignmentSignals, device) -> AlignmentSignals:
    return AlignmentSignals(
        sats={k: PooledRows(v.rows.to(device), v.key_start) for k, v in sig.sats.items()},
        vr={k: PooledRows(v.rows.to(device), v.key_start) for k, v in sig.vr.items()},
        hidden={k: v.to(device) for k, v in sig.hidden.items()},
    )


def shared_metrics(losses: dict, bb: dict, cfg: alignment.AuxConfig) -> dict[str, float]:
    """:func:`balance_metrics`' names from the metrics of :func:`claas_verl.align.balanced_backward`, plus the
    multipliers ``mopd/mult_*`` (what carried balancing records)."""
    info = {f"{t}_norm": bb.get(f"{t}_grad_norm", 0.0) for t in ("tok", "sats", "vr", "hid")}
    info["final_norm"] = bb["final_grad_norm"]
    if cfg.combine == "1:1:1":
        other = "vr" if "vr" in cfg.terms else "hid"
        info.update(sats_coef=bb["mult_sats"], other_coef=bb[f"mult_{other}"])
    else:
        info.update(aux_norm=bb["aux_grad_norm"], cos_tok_aux=bb["cos_tok_aux"], cos_sats_vr=bb["cos_sats_vr"],
                    cos_u_hid=bb["cos_u_hid"], s_norm=bb["s_norm"], scale=bb["balance_scale"], ratio=cfg.ratio,
                    fallback=bb["balance_fallback"], tok_coef=bb["tok_coef"], aux_coef=bb["aux_coef"])
    m = balance_metrics(losses, info, cfg.combine)
    m.update({f"mopd/{k}": v for k, v in bb.items() if k.startswith("mult_")})
    if "balance_fallback" in bb:
        m["mopd/balance_fallback"] = bb["balance_fallback"]
    return m


def response_lengths(data) -> torch.Tensor:
    mask = data["response_mask"]
    if getattr(mask, "is_nested", False):
        return mask.offsets().diff()
    return mask.sum(-1)


def row_temperatures(data) -> torch.Tensor:
    """``[B]`` float: the temperature verl divides each row's logits by (its ``temperature`` field; 1 without)."""
    B = len(sequences(data))
    if "temperature" not in data.keys():
        return torch.ones(B)
    temp = data["temperature"]  # a tensor per row, or one number (verl's prepare_model_inputs reads both)
    if not isinstance(temp, torch.Tensor) or getattr(temp, "is_nested", False):
        temp = torch.tensor([float(temp)] if not isinstance(temp, torch.Tensor) else temp.values().tolist())
    temp = temp.to(torch.float32).reshape(-1)
    if temp.numel() == 1:
        return temp.expand(B).clone()
    if temp.numel() != B:
        raise ValueError(f"the batch's temperature holds {temp.numel()} values for {B} rows")
    return temp


def merged_targets(targets, i: int, terms, device) -> AlignmentSignals:
    """Micro-batch ``i``'s teacher targets of every term in one :class:`AlignmentSignals`, on ``device``: a
    :class:`~claas_verl.align.TeacherTargetStore` gives them in one piece (a streamed micro-batch: ONE teacher forward
    for every term), anything with ``get(i, term)`` term by term."""
    if isinstance(targets, TeacherTargetStore):
        return targets_to(targets[i], device)
    target = AlignmentSignals()
    for term in terms:
        part = targets_to(targets.get(i, term), device)
        for name in ("sats", "vr", "hidden"):
            getattr(target, name).update(getattr(part, name))
    return target


def balance_metrics(losses: dict, info: dict, combine: str) -> dict[str, float]:
    """Per step: each loss, token/aux grad norms, cosines, balancing scale and the two parts' norms."""
    m = {f"mopd/{t}_loss": v for t, v in losses.items()}
    for t in ("sats", "vr", "hid"):
        m[f"mopd/{t}_grad_norm"] = info[f"{t}_norm"]
    m["mopd/tok_grad_norm"] = info["tok_norm"]
    m["mopd/balanced_grad_norm"] = info["final_norm"]
    if combine == "1:1:1":  # g = g_tok + ‖g_tok‖ĝ_SATS + ‖g_tok‖ĝ_other (MOPD paper Table 4)
        m["mopd/sats_coef"] = info["sats_coef"]
        m["mopd/other_coef"] = info["other_coef"]
        return m
    m.update({
        "mopd/aux_grad_norm": info["aux_norm"],  # ‖g_aux‖ of eq. (10) (direction only)
        "mopd/cos_tok_aux": info["cos_tok_aux"],
        "mopd/cos_sats_vr": info["cos_sats_vr"],
        "mopd/cos_u_hid": info["cos_u_hid"],
        "mopd/s_norm": info["s_norm"],
        "mopd/balance_scale": info["scale"],  # c = ‖g_tok‖/‖g_aux‖
        "mopd/balance_ratio": info["ratio"],
        "mopd/balance_fallback": info["fallback"],
        # norms of the two parts of eq. (9): a·‖g_tok‖ and b·c·‖g_aux‖ (their ratio is r unless a fallback)
        "mopd/tok_part_norm": info["tok_coef"] * info["tok_norm"],
        "mopd/aux_part_norm": info["aux_coef"] * info["aux_norm"],
    })
    return m


def step_inputs(engine, data, cfg: alignment.AuxConfig, groups: list[list[int]]):
    """``(module, trainable params, alignment micro-batches, their B.7 weights, aligned layers, compute device)`` of
    one balanced step."""
    module = engine.module
    params = [p for p in module.parameters() if p.requires_grad]
    micro = micro_batches(data, groups)
    weights = microbatch_weights([mb.n_resp for mb in micro])
    layers = alignment.check_layers(cfg, len(attention_modules(module)))
    return module, params, micro, weights, layers, compute_device()


def shared_step(engine, data, loss_function, cfg: alignment.AuxConfig, groups, targets, mults) -> tuple[dict, dict]:
    """``mopd.signal.passes: shared``, the floor schedule of the balanced step (docs/performance.md).

    Per micro-batch ONE student forward gives the logits of the token loss (``loss_function.shared_token_loss``,
    the same ℓ_tok as verl's pass: :meth:`claas_verl.mopd.trainer.loss.MOPDLoss.shared_token_loss`) and every
    alignment signal; then one backward per term on that graph, each term's gradient accumulated on the device
    (:func:`claas_verl.align.balanced_backward`, ``single_forward=True``): a term read at layer ℓ
    back-propagates through layers ≤ ℓ only and never through the LM head. With carried multipliers, one
    backward of ``Σ_t α_t·w·ℓ_t`` instead. The micro-batches and weights are verl's (B.7), as in the separate
    schedule; the LM head is the model's own (no chunked logits processor: the ``[tokens, V]`` logits of a
    micro-batch exist once, as in verl's forward). Returns verl's ``forward_backward_batch``-shaped outputs and
    the step's ``mopd/`` metrics; ``.grad`` then holds the balanced gradient.
    """
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.engine.utils import postprocess_batch_func

    token_loss = getattr(loss_function, "shared_token_loss", None)
    if token_loss is None:
        raise ValueError("mopd.signal.passes=shared computes the token loss from the shared forward and needs the "
                         f"MOPD loss (MOPDLoss.shared_token_loss); got {type(loss_function).__name__}. Set "
                         "mopd.signal.passes=separate to run verl's token pass")
    module, params, micro, weights, layers, device = step_inputs(engine, data, cfg, groups)
    autocast = engine_autocast(engine, device)
    resp_len = response_lengths(data)
    temperature = row_temperatures(data)
    names = {t: alignment.BALANCE_TERM[t] for t in cfg.terms}
    values = {t: 0.0 for t in cfg.terms}
    per_mb: list[dict] = []

    def forward(model, item):
        i, mb = item
        mb, rows = mb.to(device), groups[i]
        target = merged_targets(targets, i, cfg.terms, device)  # a streamed one: the teacher forward runs first
        with autocast:
            out, sig = alignment_signals(
                model, mb.input_ids, mb.attention_mask, mb.regions, position_ids=mb.position_ids,
                terms=cfg.terms, pooled_layers=layers, hidden_layers=layers, use_cache=False,
            )
            logits = alignment.response_logits(out.logits, mb.attention_mask.sum(-1), resp_len[rows].to(device),
                                               temperature[rows].to(device))
            del out
            tok, tok_metrics = token_loss(logits, data, rows)
            terms = alignment_losses(sig, target, mb.regions)
        losses = {"tok": tok}
        for t in cfg.terms:
            if not terms[t].loss.requires_grad:
                raise ValueError(f"alignment term {t!r} has no gradient path to the student in micro-batch {i} "
                                 "(see _alignment_pass)")
            losses[names[t]] = terms[t].loss
            values[t] += float(terms[t].loss.detach()) * weights[i]
        weighted = tok.detach() * weights[i]
        per_mb.append({"loss": float(weighted), "metrics": {
            "mopd/tok_loss": Metric(value=weighted, aggregation=AggregationType.SUM), **tok_metrics}})
        return losses

    closures = {n: (lambda out, item, n=n: out[n]) for n in ("tok", *names.values())}
    sync, group = reduction(params)
    engine.optimizer_zero_grad()
    with params_gathered_through_backward(engine, several=True):
        bb = balanced_backward(module, list(enumerate(micro)), weights, forward, closures, ratio=cfg.ratio,
                               rho=cfg.rho, variant=cfg.combine, single_forward=True, multipliers=mults,
                               sync=sync, group=group)
    outputs = postprocess_batch_func(per_mb, None, data)  # what verl's forward_backward_batch returns
    if mults is not None:
        m = {f"mopd/{t}_loss": v for t, v in values.items()}
        m.update({f"mopd/{k}": v for k, v in mults.items()})
        m["mopd/balance_carried"] = 1.0
        return outputs, m
    return outputs, shared_metrics(values, bb, cfg)


def carried_pass(module, terms, mults, params, micro, weights, targets, layers, device, autocast) -> dict:
    """Carried balancing (:mod:`claas_verl.align.carried`): ``.grad`` holds g_tok from the token pass; scale it by
    α_tok, then per micro-batch ONE forward of every term and one backward of ``Σ_t α_t·w·ℓ_t`` on top, so
    ``.grad = α_tok·g_tok + Σ_t α_t·g_t`` with the multipliers of the last exact step."""
    a_tok = mults["mult_tok"]
    if a_tok != 1.0:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(a_tok)
    losses = {t: 0.0 for t in terms}
    for i, (mb, w) in enumerate(zip(micro, weights)):
        mb = mb.to(device)
        target = merged_targets(targets, i, terms, device)  # a streamed one: the teacher forward runs first
        with autocast:
            _, sig = alignment_signals(
                module, mb.input_ids, mb.attention_mask, mb.regions, position_ids=mb.position_ids,
                terms=terms, pooled_layers=layers, hidden_layers=layers, use_cache=False, logits=False,
            )
            values = alignment_losses(sig, target, mb.regions)
        total = sum(mults[f"mult_{alignment.BALANCE_TERM[t]}"] * w * values[t].loss for t in terms)
        if not total.requires_grad:
            raise ValueError(f"the alignment terms {list(terms)} have no gradient path to the student in "
                             f"micro-batch {i} (see _alignment_pass)")
        total.backward()
        for t in terms:
            losses[t] += float(values[t].loss.detach()) * w
        del sig, values, total, target
    m = {f"mopd/{t}_loss": v for t, v in losses.items()}
    m.update({f"mopd/{k}": v for k, v in mults.items()})
    m["mopd/balance_carried"] = 1.0
    return m


def alignment_pass(module, term, micro, weights, targets, layers, device, autocast) -> float:
    """One forward + backward per micro-batch of one alignment term; its gradient accumulates in ``.grad``."""
    total = 0.0
    for i, (mb, w) in enumerate(zip(micro, weights)):
        mb = mb.to(device)
        # before the student's forward: a streamed micro-batch runs its teacher forward here, so the two
        # forwards' activations are never alive together
        target = targets_to(targets.get(i, term), device)
        with autocast:
            _, sig = alignment_signals(
                module, mb.input_ids, mb.attention_mask, mb.regions, position_ids=mb.position_ids,
                terms=[term], pooled_layers=layers, hidden_layers=layers, use_cache=False, logits=False,
            )
            value = alignment_losses(sig, target, mb.regions)[term]
        loss = value.loss * w
        if not loss.requires_grad:
            raise ValueError(
                f"alignment term {term!r} has no gradient path to the student in micro-batch {i}: the "
                "attention/hidden taps were detached (a wrapper or kernel that bypasses the hooked q/k/v "
                "projections?); refusing to add a zero gradient that would hide it"
            )
        loss.backward()
        total += float(loss.detach())
        del sig, value, loss, target
    return total
