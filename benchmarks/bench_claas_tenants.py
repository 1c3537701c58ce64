"""Serving several CLaaS tenants against one tenant under the same total load, over real HTTP (tiny model, CPU).

Each configuration runs ``--clients`` concurrent clients (threads), each sending ``--requests`` chats of exactly
``--tokens`` sampled tokens (EOS off), recorded and rewarded (feedback into the replay buffer), through the chat API
on 127.0.0.1:

* ``1 tenant``: the single-tenant service over ``HFBackend`` serving one LoRA adapter, every client with its own key;
* ``N tenants, all loaded``: ``claas.service.tenants`` with one tenant per client, ``TenantHFBackend`` with room for
  every tenant's adapter, one replay partition per tenant;
* ``N tenants, cache of 2``: the same with room for two adapters, so requests of round-robin tenants load evicted
  adapters again on demand (counted as reloads).

Printed: requests/s and sampled tokens/s over the whole run, latency p50/p95 of one chat, reloads, and whether every
reply named its own tenant's adapter digest. The HF backend generates one request at a time (its lock), so the
comparison is the cost of the tenant bookkeeping and the adapter switches, not of batching. Memory per tenant at
1.5B and 8B is the table of ``python -m claas_verl.claas.tenants.memory`` (docs/performance.md).

    python benchmarks/bench_claas_tenants.py [--clients 4] [--requests 8] [--tokens 16]

This measures serving only; the training job's side is benchmarks/bench_claas_tenants_training.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time

import httpx
import torch

USER = [{"role": "user", "content": "Tell me about the sea."}]


def make_adapter(student, out: str, seed: int) -> str:
    from claas_verl.tiny.adapters import random_lora_adapter

    random_lora_adapter(student, out, seed=seed, rank=8)
    return out


def drive(url: str, keys: list[str], requests: int, tokens: int) -> dict:
    """Every key's client sends ``requests`` chats (and their feedback) concurrently; returns the measurements."""
    def client(key: str) -> tuple[list[float], int, list[tuple[str, str | None]]]:
        lat, n_tok, seen = [], 0, []
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(timeout=600) as http:
            for i in range(requests):
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/chat/completions", headers=headers,
                              json={"messages": USER, "max_tokens": tokens, "seed": i,
                                    "metadata": {"scenario_id": i}}).json()
                lat.append(time.perf_counter() - t0)
                n_tok += r["usage"]["completion_tokens"]
                seen.append((r["claas"]["tenant"], r["claas"]["adapter_sha256"]))
                http.post(f"{url}/v1/feedback", headers=headers, json={"request_id": r["id"], "reward": 1})
        return lat, n_tok, seen

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
        results = list(pool.map(client, keys))
    wall = time.perf_counter() - t0
    lat = sorted(x for r in results for x in r[0])
    return {"wall_s": wall, "requests": len(lat), "tokens": sum(r[1] for r in results),
            "p50_ms": 1e3 * statistics.median(lat), "p95_ms": 1e3 * lat[int(0.95 * (len(lat) - 1))],
            "seen": [s for r in results for s in r[2]]}


def run_single(student, adapter: str, keys: list[str], args) -> dict:
    from claas_verl.claas.replay import ReplayBuffer
    from claas_verl.claas.service import ChatService, HFBackend, ServiceConfig, build_app
    from claas_verl.claas.service.server import ServiceThread

    backend = HFBackend(student, adapter_path=adapter, default_max_tokens=args.tokens, seed=0)
    backend.eos_token_ids = set()  # every reply exactly --tokens long: the same work whichever adapter serves
    buffer = ReplayBuffer(b_max=10_000, b_min=1, a_max=100, seed=0)
    service = ChatService(backend, buffer, config=ServiceConfig(api_keys=tuple(keys)))
    server = ServiceThread(build_app(service)).start()
    try:
        out = drive(server.url, keys, args.requests, args.tokens)
    finally:
        server.stop()
    out["reloads"] = 0
    out["own_digest"] = all(t == "default" and d is not None for t, d in out["seen"])
    return out


def run_tenants(student, adapters: dict[str, str], keys: list[str], capacity: int, args) -> dict:
    from claas_verl.claas.replay.partitions import PartitionedReplay
    from claas_verl.claas.service import ChatService, ServiceConfig, build_app
    from claas_verl.claas.service.hf_tenants import TenantHFBackend
    from claas_verl.claas.service.server import ServiceThread
    from claas_verl.claas.tenants.adapters import adapter_file_digest

    tenants = {t: {"api_keys": [k], "b_min": 1, "b_max": 10_000, "a_max": 100} for t, k in zip(adapters, keys)}
    backend = TenantHFBackend(student, list(tenants), max_loaded_adapters=capacity, default_max_tokens=args.tokens,
                              seed=0)
    backend.eos_token_ids = set()
    replay = PartitionedReplay(partitions={t: {k: c[k] for k in ("b_min", "b_max", "a_max")}
                                           for t, c in tenants.items()}, seed=0)
    service = ChatService(backend, replay, config=ServiceConfig(tenants=tenants, admin_key="admin"))
    for t, path in adapters.items():
        service.load_adapter_sync(path, tenant=t)
    reloads_before = backend.cache.counts["reloads"]
    server = ServiceThread(build_app(service)).start()
    try:
        out = drive(server.url, keys, args.requests, args.tokens)
    finally:
        server.stop()
    out["reloads"] = backend.cache.counts["reloads"] - reloads_before
    digests = {t: adapter_file_digest(p) for t, p in adapters.items()}
    out["own_digest"] = all(digests[t] == d for t, d in out["seen"])
    out["partitions"] = {t: len(replay.part(t)) for t in tenants}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from claas_verl.tiny import ensure_tiny

    student = ensure_tiny().student
    tmp = tempfile.mkdtemp(prefix="bench_tenants_")
    names = [f"t{i}" for i in range(args.clients)]
    adapters = {t: make_adapter(student, f"{tmp}/{t}", seed=i + 1) for i, t in enumerate(names)}
    keys = [f"sk-{t}" for t in names]
    rows = [("1 tenant", run_single(student, adapters[names[0]], keys, args)),
            (f"{args.clients} tenants, all loaded", run_tenants(student, adapters, keys, args.clients, args)),
            (f"{args.clients} tenants, cache of 2", run_tenants(student, adapters, keys, 2, args))]
    print(f"{args.clients} clients x {args.requests} chats x {args.tokens} tokens, tiny model, CPU, "
          f"{torch.get_num_threads()} torch thread")
    print("| configuration | requests/s | tokens/s | p50 latency | p95 latency | adapter reloads | every reply "
          "named its own adapter |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['requests'] / r['wall_s']:.2f} | {r['tokens'] / r['wall_s']:.1f} | "
              f"{r['p50_ms']:.0f} ms | {r['p95_ms']:.0f} ms | {r['reloads']} | {r['own_digest']} |")
    for name, r in rows[1:]:
        print(f"{name}: entries per partition {r['partitions']}")


if __name__ == "__main__":
    main()
