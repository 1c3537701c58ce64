"""Prometheus metrics of the chat service (``GET /metrics``, text exposition format, ``prometheus-client``).

Counters and gauges are read from the service's own bookkeeping when scraped (one source of truth with
``/v1/claas/stats``); only latencies are observed as they happen. Each app has its own registry, so several
services in one process (tests) never share series.

Series::

    claas_turns_total{outcome}                 served / pending / accepted / submitted / rate_limited / ...
    claas_turns_dropped_total{reason}          every drop and refusal, by reason
    claas_key_turns_total{key_id, outcome}     the same per API key id (never the key)
    claas_key_buffer_entries{key_id}           entries of the last b_max a key wrote (its buffer share's count)
    claas_pending_turns, claas_pending_bytes   the table of turns awaiting feedback
    claas_policy_version                       the version new requests are served with
    claas_buffer_entries, claas_buffer_capacity   the replay buffer (when the sink or the job reports it)
    claas_updates_total, claas_last_update_timestamp_seconds   trainer updates (training job only)
    claas_request_seconds{endpoint}            latency histogram per endpoint (chat: to the first byte of a stream)
    claas_tenant_turns_total{tenant, outcome}  turns by tenant (drops and refusals included, by their counter name)
    claas_tenant_pending_turns{tenant}         a tenant's turns awaiting feedback
    claas_tenant_policy_version{tenant}        the version a tenant's new requests are served with
    claas_tenant_updates_total{tenant}         a tenants job: updates granted to the tenant
    claas_tenant_trained_version{tenant}       a tenants job: the tenant's newest trained version
    claas_tenant_probe_failures_total{tenant}  a tenants job: reloads whose serving probe did not match (the alarm)
    claas_tenant_waiting_updates{tenant}       a tenants job: updates of others since the tenant became ready
"""

from __future__ import annotations

from collections.abc import Callable


class ServiceMetrics:
    """The registry of one service: ``observe(endpoint, seconds)`` as requests end, ``render()`` for a scrape.

    ``snapshot()`` returns ``{"counts", "keys", "buffer_share_held", "pending_now", "pending_bytes",
    "policy_version", "buffer", "updates", "last_update_unix"}`` (missing keys are skipped); it may block, so
    render off the event loop.
    """

    def __init__(self, snapshot: Callable[[], dict]):
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self._snapshot = snapshot
        self.latency = Histogram("claas_request_seconds", "Request latency by endpoint (seconds)", ["endpoint"],
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.registry.register(_Collector(snapshot))

    def observe(self, endpoint: str, seconds: float) -> None:
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Collector:
    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self._snapshot()
        turns = CounterMetricFamily("claas_turns", "Turns by outcome", labels=["outcome"])
        drops = CounterMetricFamily("claas_turns_dropped", "Turns dropped or refused, by reason", labels=["reason"])
        for name, value in snap["counts"].items():
            if name.startswith("dropped_") or name.startswith("rejected_"):
                drops.add_metric([name.split("_", 1)[1] if name.startswith("dropped_") else name], value)
            else:
                turns.add_metric([name], value)
        yield turns
        yield drops
        per_key = CounterMetricFamily("claas_key_turns", "Turns by API key id and outcome",
                                      labels=["key_id", "outcome"])
        for key, counts in snap.get("keys", {}).items():
            for name, value in counts.items():
                if not name.startswith("pending_"):
                    per_key.add_metric([key, name], value)
        yield per_key
        held = snap.get("buffer_share_held")
        if held is not None:
            share = GaugeMetricFamily("claas_key_buffer_entries", "Entries of the last b_max accepted that each API "
                                      "key wrote (an upper bound of what it holds in the buffer)", labels=["key_id"])
            for key, value in held.items():
                share.add_metric([key], value)
            yield share
        for name, doc, value in (
            ("claas_pending_turns", "Turns awaiting feedback", snap.get("pending_now")),
            ("claas_pending_bytes", "Bytes held by turns awaiting feedback", snap.get("pending_bytes")),
            ("claas_policy_version", "Policy version new requests are served with", snap.get("policy_version")),
            ("claas_buffer_entries", "Entries in the replay buffer", (snap.get("buffer") or {}).get("size")),
            ("claas_buffer_capacity", "Replay buffer capacity B_max", (snap.get("buffer") or {}).get("b_max")),
            ("claas_last_update_timestamp_seconds", "Unix time of the last trainer update",
             snap.get("last_update_unix")),
        ):
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        tenants = snap.get("tenants") or {}
        if tenants:
            t_turns = CounterMetricFamily("claas_tenant_turns", "Turns by tenant and outcome (every counter)",
                                          labels=["tenant", "outcome"])
            t_pending = GaugeMetricFamily("claas_tenant_pending_turns", "Turns of a tenant awaiting feedback",
                                          labels=["tenant"])
            t_version = GaugeMetricFamily("claas_tenant_policy_version", "Version a tenant's new requests get",
                                          labels=["tenant"])
            for tenant, view in tenants.items():
                for name, value in view["counts"].items():
                    t_turns.add_metric([tenant, name], value)
                t_pending.add_metric([tenant], view["pending_now"])
                t_version.add_metric([tenant], view["policy_version"])
            yield t_turns
            yield t_pending
            yield t_version
        training = snap.get("tenant_training")
        if training:
            per = training["tenants"]
            series = (
                (CounterMetricFamily, "claas_tenant_updates", "Updates granted to a tenant", "granted"),
                (GaugeMetricFamily, "claas_tenant_trained_version", "A tenant's newest trained version",
                 "trained_version"),
                (CounterMetricFamily, "claas_tenant_probe_failures", "Reloads of a tenant whose serving probe did "
                 "not match the trainer's forward (the tenant kept its previous version)", "probe_failures"),
                (GaugeMetricFamily, "claas_tenant_waiting_updates", "Updates of other tenants since the tenant "
                 "became ready (0: not waiting)", "waiting"),
            )
            for family, name, doc, key in series:
                metric = family(name, doc, labels=["tenant"])
                for tenant, view in per.items():
                    metric.add_metric([tenant], float(view[key] or 0))
                yield metric
        if snap.get("updates") is not None:
            yield CounterMetricFamily("claas_updates", "Trainer updates", value=float(snap["updates"]))
