"""What the chat service tells about itself: the admin's stats (every tenant), one key's stats (its own tenant
only), one tenant's view (served version, adapter digest, counters, pending turns, partition fill) and the snapshot
``/metrics`` renders. Functions of a :class:`~claas_verl.claas.service.app.ChatService`; they read its ledgers,
never change them (blocking: the sink's fill and the job's extra stats; call them off the event loop)."""

from __future__ import annotations

from collections import Counter

from claas_verl.claas.service.recorder import COUNTERS


def recorder_stats(service) -> dict:
    """Every recorder counter summed over the tenants' ledgers (one ledger without tenants)."""
    per = [ledger.recorder.stats() for ledger in service.ledgers.values()]
    if len(per) == 1:
        return per[0]
    out = {name: sum(p[name] for p in per) for name in (*COUNTERS, "pending_now", "pending_bytes")}
    sink: Counter = Counter()
    for p in per:
        sink.update(p["sink"])
    out["sink"] = dict(sink)
    return out


def key_stats(service) -> dict:
    return {k: v for ledger in service.ledgers.values() for k, v in ledger.recorder.key_stats().items()}


def tenant_stats(service, tenant: str) -> dict:
    """One tenant's view: its served version and adapter digest, its counters (its keys only), pending turns,
    buffer share and, when the sink reports it, its replay partition's fill."""
    ledger = service.ledgers[tenant]
    rec = ledger.recorder.stats()
    version = service.served_version(tenant)
    out = {"tenant": tenant, "policy_version": version, "adapter_sha256": service.adapter_sha256(tenant, version),
           "counts": {name: rec[name] for name in COUNTERS if rec[name]}, "pending_now": rec["pending_now"],
           "pending_bytes": rec["pending_bytes"], "buffer_share": ledger.share_stats(), "buffer": None}
    fill = getattr(ledger.recorder.sink, "fill", None)
    if fill is not None:
        try:
            size, b_max = fill()
            out["buffer"] = {"size": size, "b_max": b_max}
        except Exception:  # noqa: BLE001 - stats report what answers; /health reports an unreachable buffer
            pass
    return out


def admin_stats(service) -> dict:
    """The admin view: recorder counters, a ``turns`` summary (recorded, pending, completed, expired, dropped by
    reason), per-key counters under ``keys``, the served version, every tenant's view under ``tenants``
    (:meth:`tenant_stats`), and whatever ``extra_stats`` adds (the training job: buffer statistics and
    updates). With tenants the counters are summed over them."""
    rec = recorder_stats(service)
    dropped = {name[len("dropped_"):]: rec[name] for name in COUNTERS if name.startswith("dropped_")}
    dropped.update({name: rec[name] for name in COUNTERS if name.startswith("rejected_")})
    share = service.turns.share_stats() if service.turns is not None else None
    out = {**rec, "policy_version": service.backend.policy_version, "model": service.backend.served_model,
           "reloads": service.reloads, "accepting": service.accepting, "keys": key_stats(service),
           "buffer_share": share, "tenants": {t: tenant_stats(service, t) for t in service.ledgers},
           "turns": {"served": rec["served"], "recorded": rec["pending"] + rec["graded"],
                     "pending": rec["pending_now"], "completed": rec["submitted"],
                     "accepted": rec["accepted"], "expired": rec["dropped_timeout"],
                     "dropped": dropped}}
    if service.extra_stats is not None:
        out.update(service.extra_stats())
    return out


def user_stats(service, owner: str) -> dict:
    """The view of one API key: its own counters and pending turns, its buffer share, the served model and
    its tenant's version; with tenants also its tenant's view (:meth:`tenant_stats`), never another tenant's."""
    tenant = service.tenant_of(owner)
    ledger = service.ledgers[tenant]
    share = ledger.share_stats()
    out = {"key_id": owner, "tenant": tenant, "policy_version": service.served_version(tenant),
           "model": service.backend.served_model, **ledger.recorder.key_stats(owner)[owner],
           "buffer_share": {"max": share["max"], "limit": share["limit"], "held": share["held"].get(owner, 0)}}
    if service.multi_tenant:
        out["tenant_stats"] = tenant_stats(service, tenant)
        out["adapter_sha256"] = out["tenant_stats"]["adapter_sha256"]
    return out


def metrics_snapshot(service) -> dict:
    """What :class:`~claas_verl.claas.service.metrics.ServiceMetrics` exports (blocking: the job's extra stats)."""
    rec = recorder_stats(service)
    extra = service.extra_stats() if service.extra_stats is not None else {}
    buffer = extra.get("buffer")
    if buffer is None and service.recorder is not None and hasattr(service.recorder.sink, "buffer"):
        buffer = service.recorder.sink.buffer.stats()
    held = {k: v for ledger in service.ledgers.values() if ledger.buffer_share.enabled
            for k, v in ledger.buffer_share.held().items()}
    tenants = {}
    for t, ledger in service.ledgers.items():
        trec = ledger.recorder.stats()
        tenants[t] = {"counts": {name: trec[name] for name in COUNTERS}, "pending_now": trec["pending_now"],
                      "policy_version": service.served_version(t)}
    return {"counts": {name: rec[name] for name in COUNTERS}, "keys": key_stats(service),
            "buffer_share_held": held if any(led.buffer_share.enabled for led in service.ledgers.values()) else None,
            "pending_now": rec["pending_now"], "pending_bytes": rec["pending_bytes"],
            "policy_version": service.backend.policy_version, "buffer": buffer, "updates": extra.get("updates"),
            "last_update_unix": extra.get("last_update_unix"), "tenants": tenants,
            "tenant_training": extra.get("tenant_training")}
