"""Replay-buffer actor throughput, sample latency and memory (issue #3 targets). Prints figures; not a test.

    python benchmarks/bench_replay.py            # full run
    python benchmarks/bench_replay.py --quick    # ~4x fewer batches and a 2,000-entry memory probe

Throughput: 1, 4 and 8 concurrent producer actors each send batches of 50 entries (2,000-token responses plus a
512-token prompt) to one ReplayBufferActor, as one columnar ``PackedEntries`` per batch (``--format entries``
sends lists of ``ReplayEntry`` instead, for comparison) while the driver samples M=8 and calls on_update in a loop.
Figures: entries inserted per second (target >= 12,000 on a 2-core machine) and the consumer's sample latency
p50/p99 (target p99 <= 10 ms for M=8 while 4 producers add). Memory: RSS growth and token bytes of a plain
ReplayBuffer holding 10,000 such entries.

Two reference figures put those in context:

* actor CPU per batch: unpickling a batch as Ray does and ``ReplayBuffer.add`` in one process, without Ray. Its
  inverse is the ingest ceiling the actor's own code sets (about 90,000 entries/s on one core for packed batches).
* the no-op actor: the same producers and consumer against an actor that does no work. On 2 shared cores Ray's
  per-call cost (a 500 KB argument goes through the object store) and the CPU contention between producers,
  raylet, actor and driver bound both figures; the replay actor is reported as a ratio to this floor.

Producer and consumer processes share the machine's cores with the actor, so on a machine that other jobs also load
the figures are lower bounds. ``--inflight N`` lets each producer keep N adds unacknowledged.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import pickle
import time

import numpy as np
import ray

from claas_verl.replay import PackedEntries, ReplayBuffer, ReplayEntry, make_replay_actor

TARGET_ENTRIES_PER_S = 12_000
TARGET_P99_MS = 10.0


def make_batch(rng: np.random.Generator, batch: int, prompt_tokens: int, response_tokens: int, tag: str) -> list:
    return [
        ReplayEntry(
            uid=f"{tag}-{i}",
            scenario_id=i,
            step_idx=0,
            prompt_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
            response_ids=rng.integers(0, 150_000, response_tokens, dtype=np.int32),
            behaviour_logprob=-float(response_tokens) * 0.5,
            reward=1.0,
        )
        for i in range(batch)
    ]


@ray.remote(num_cpus=0)
class Producer:
    """Sends one prebuilt batch over and over, with fresh uids (token arrays are shared: serialisation dominates)."""

    def __init__(self, pid: int, batch: int, prompt_tokens: int, response_tokens: int, fmt: str):
        self.pid, self.fmt = pid, fmt
        self.template = make_batch(np.random.default_rng(pid), batch, prompt_tokens, response_tokens, f"p{pid}")
        self.packed = PackedEntries.from_entries(self.template)

    def ping(self) -> bool:
        return True

    def batch(self, round_id: int, b: int):
        uids = [f"r{round_id}-p{self.pid}-b{b}-{i}" for i in range(len(self.template))]
        if self.fmt == "packed":
            return dataclasses.replace(self.packed, uid=tuple(uids))
        out = []
        for e, uid in zip(self.template, uids):
            e2 = copy.copy(e)
            e2.uid = uid
            out.append(e2)
        return out

    def run(self, buffer, n_batches: int, round_id: int, inflight: int) -> int:
        """Send n_batches, keeping at most ``inflight`` adds unacknowledged (1 = wait for each)."""
        accepted, pending = 0, []
        for b in range(n_batches):
            pending.append(buffer.add.remote(self.batch(round_id, b)))
            if len(pending) >= inflight:
                accepted += ray.get(pending.pop(0))
        return accepted + sum(ray.get(pending))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


def bench_memory(n_entries: int, prompt_tokens: int, response_tokens: int, fmt: str) -> None:
    rng = np.random.default_rng(0)
    gc.collect()
    before = rss_bytes()
    buf = ReplayBuffer(b_max=n_entries, b_min=1, a_max=0)
    for start in range(0, n_entries, 50):
        batch = make_batch(rng, min(50, n_entries - start), prompt_tokens, response_tokens, f"m{start}")
        buf.add(PackedEntries.from_entries(batch) if fmt == "packed" else batch)
    gc.collect()
    grown = rss_bytes() - before
    token_bytes = buf.stats()["stored_nbytes"]
    scale = 10_000 / n_entries
    print(
        f"memory: {n_entries} entries ({prompt_tokens}+{response_tokens} tokens) -> RSS +{grown / 2**20:.1f} MiB, "
        f"token arrays {token_bytes / 2**20:.1f} MiB"
    )
    print(
        f"memory per 10,000 entries: RSS {grown * scale / 2**20:.1f} MiB, token arrays "
        f"{token_bytes * scale / 2**20:.1f} MiB, overhead {(grown - token_bytes) / n_entries:.0f} B/entry"
    )


def bench_actor_cpu(args) -> None:
    """The actor's own serial cost per batch, without Ray: unpickle (protocol 5, out-of-band buffers, as Ray does)
    plus ``ReplayBuffer.add``, with a sample and an update every 4th batch. Its inverse is the rate one actor could
    ingest if Ray's transport cost nothing: the ceiling that the actor's code itself sets."""
    rng = np.random.default_rng(0)
    template = make_batch(rng, args.batch, args.prompt_tokens, args.response_tokens, "cpu")
    n = 200
    for fmt in ("packed", "entries"):
        wire = []
        for b in range(n):
            batch = [copy.copy(e) for e in template]
            for i, e in enumerate(batch):
                e.uid = f"{fmt}-{b}-{i}"
            obj = PackedEntries.from_entries(batch) if fmt == "packed" else batch
            buffers: list = []
            wire.append((pickle.dumps(obj, protocol=5, buffer_callback=buffers.append), buffers))
        buf = ReplayBuffer(b_max=1000, b_min=8, a_max=5, seed=0)
        t0 = time.perf_counter()
        for b, (data, buffers) in enumerate(wire):
            buf.add(pickle.loads(data, buffers=buffers))
            if b % 4 == 3:
                buf.sample(args.m)
                buf.on_update()
        per_batch = (time.perf_counter() - t0) / n
        print(f"actor CPU per batch of {args.batch} ({fmt}): {per_batch * 1e3:.3f} ms (unpickle + add, amortised "
              f"sample/update) -> ceiling {args.batch / per_batch:,.0f} entries/s on one core")


@ray.remote(num_cpus=0)
class NoOpBuffer:
    """The Ray floor: same calls as the replay actor, no work (add counts, sample returns a prebuilt list).

    Its figures are what Ray itself costs on this machine for the same traffic; the replay actor's figures are
    printed as ratios to them.
    """

    def __init__(self, m: int, prompt_tokens: int, response_tokens: int):
        self.sample_out = make_batch(np.random.default_rng(0), m, prompt_tokens, response_tokens, "noop")

    async def add(self, batch) -> int:
        return len(batch)

    async def sample_when_ready(self, m: int, timeout_s: float):
        return self.sample_out[:m]

    async def on_update(self) -> int:
        return 0

    async def size(self) -> int:
        return 0


def run_round(actor, producers, n_prod: int, args, round_id: int) -> dict:
    """n_prod producers add while the driver samples M and calls on_update; return the round's figures."""
    refs = [p.run.remote(actor, args.batches, round_id, args.inflight) for p in producers[:n_prod]]
    t0 = time.perf_counter()
    latencies = []
    while True:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(done) == len(refs):
            break
        s0 = time.perf_counter()  # one round trip: wait (0 s if ready) and sample in the actor
        got = ray.get(actor.sample_when_ready.remote(args.m, 1.0))
        if got is not None:
            latencies.append((time.perf_counter() - s0) * 1e3)
            ray.get(actor.on_update.remote())
        time.sleep(args.consumer_sleep_ms / 1e3)
    elapsed = time.perf_counter() - t0
    accepted = sum(ray.get(refs))
    lat = np.array(latencies) if latencies else np.array([np.nan])
    return {"rate": accepted / elapsed, "accepted": accepted, "samples": len(latencies),
            "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))}


def bench_actor(args) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = make_replay_actor(b_max=1000, b_min=8, a_max=5, seed=0, max_restarts=0)
        noop = NoOpBuffer.remote(args.m, args.prompt_tokens, args.response_tokens)
        producers = [
            Producer.remote(p, args.batch, args.prompt_tokens, args.response_tokens, args.format)
            for p in range(max(args.producers))
        ]
        ray.get([p.ping.remote() for p in producers] + [actor.size.remote(), noop.size.remote()])  # start-up
        for target in (actor, noop):
            ray.get(producers[0].run.remote(target, 2, -1, 1))  # warm-up
        for round_id, n_prod in enumerate(args.producers):
            r = run_round(actor, producers, n_prod, args, round_id)
            print(
                f"producers={n_prod}: {r['accepted']} entries = {r['rate']:,.0f} entries/s "
                f"({r['rate'] / TARGET_ENTRIES_PER_S:.2f}x target {TARGET_ENTRIES_PER_S:,}); sample M={args.m} "
                f"latency p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms over {r['samples']} samples "
                f"(p99 {r['p99'] / TARGET_P99_MS:.2f}x target {TARGET_P99_MS} ms)"
            )
            if not args.skip_noop:
                f = run_round(noop, producers, n_prod, args, round_id)
                print(
                    f"    no-op actor, same traffic (the Ray floor here): {f['rate']:,.0f} entries/s, sample p50 "
                    f"{f['p50']:.2f} ms p99 {f['p99']:.2f} ms -> replay actor at {r['rate'] / f['rate']:.2f}x the "
                    f"floor's throughput, {r['p99'] / f['p99']:.2f}x its p99"
                )
        s = ray.get(actor.stats.remote())
        print(
            f"actor stats: size={s['size']} inserted={s['inserted']} evicted_fifo={s['evicted_fifo']} "
            f"evicted_age={s['evicted_age']} updates={s['update_count']} max_uses={s['max_uses']}"
        )
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and a smaller memory probe")
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--batches", type=int, default=None, help="batches per producer (default 40, quick 10)")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--response-tokens", type=int, default=2000)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--format", choices=("packed", "entries"), default="packed",
                        help="what producers send: one PackedEntries per batch, or a list of ReplayEntry")
    parser.add_argument("--consumer-sleep-ms", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=1,
                        help="adds a producer keeps unacknowledged (1: each waits for its ack; an asynchronous "
                             "producer such as the chat service's sink does not wait at all)")
    parser.add_argument("--skip-noop", action="store_true", help="skip the no-op actor baseline rounds")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.batches is None:
        args.batches = 10 if args.quick else 40
    print(f"bench_replay: pid {os.getpid()}, {os.cpu_count()} CPUs visible, load avg {os.getloadavg()[0]:.1f}, "
          f"producers send {args.format} batches of {args.batch}, {args.inflight} in flight each")
    if not args.skip_memory:
        bench_memory(2_000 if args.quick else 10_000, args.prompt_tokens, args.response_tokens, args.format)
    bench_actor_cpu(args)
    bench_actor(args)


if __name__ == "__main__":
    main()
