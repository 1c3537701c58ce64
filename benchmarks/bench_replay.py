"""Replay-buffer actor throughput, sample latency and memory (issue #3 targets). Prints figures; not a test.

    python benchmarks/bench_replay.py            # full run
    python benchmarks/bench_replay.py --quick    # ~4x fewer batches and a 2,000-entry memory probe

Throughput: 1, 4 and 8 concurrent producer actors each send batches of 50 entries (2,000-token responses plus a
512-token prompt, packed int32) to one ReplayBufferActor while the driver samples M=8 and calls on_update in a loop.
Figures: entries inserted per second (target >= 12,000 on a 2-core machine) and the consumer's sample latency
p50/p99 (target p99 <= 10 ms for M=8 while 4 producers add). Memory: RSS growth and token bytes of a plain
ReplayBuffer holding 10,000 such entries.

Producer and consumer processes share the machine's cores with the actor, so on a machine that other jobs also load
the figures are lower bounds.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import time

import numpy as np
import ray

from claas_verl.replay import ReplayBuffer, ReplayEntry, make_replay_actor

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

    def __init__(self, pid: int, batch: int, prompt_tokens: int, response_tokens: int):
        self.pid = pid
        self.template = make_batch(np.random.default_rng(pid), batch, prompt_tokens, response_tokens, f"p{pid}")

    def ping(self) -> bool:
        return True

    def run(self, buffer, n_batches: int, round_id: int) -> int:
        accepted = 0
        for b in range(n_batches):
            batch = []
            for i, e in enumerate(self.template):
                e2 = copy.copy(e)
                e2.uid = f"r{round_id}-p{self.pid}-b{b}-{i}"
                batch.append(e2)
            accepted += ray.get(buffer.add.remote(batch))
        return accepted


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


def bench_memory(n_entries: int, prompt_tokens: int, response_tokens: int) -> None:
    rng = np.random.default_rng(0)
    gc.collect()
    before = rss_bytes()
    buf = ReplayBuffer(b_max=n_entries, b_min=1, a_max=0)
    for start in range(0, n_entries, 50):
        buf.add(make_batch(rng, min(50, n_entries - start), prompt_tokens, response_tokens, f"m{start}"))
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


def bench_actor(args) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = make_replay_actor(b_max=1000, b_min=8, a_max=5, seed=0, max_restarts=0)
        producers = [
            Producer.remote(p, args.batch, args.prompt_tokens, args.response_tokens) for p in range(max(args.producers))
        ]
        ray.get([p.ping.remote() for p in producers] + [actor.size.remote()])  # exclude worker start-up
        ray.get(producers[0].run.remote(actor, 2, -1))  # warm-up
        for round_id, n_prod in enumerate(args.producers):
            refs = [p.run.remote(actor, args.batches, round_id) for p in producers[:n_prod]]
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
            rate = accepted / elapsed
            lat = np.array(latencies) if latencies else np.array([np.nan])
            print(
                f"producers={n_prod}: {accepted} entries in {elapsed:.2f} s = {rate:,.0f} entries/s "
                f"({rate / TARGET_ENTRIES_PER_S:.2f}x target {TARGET_ENTRIES_PER_S:,}); sample M={args.m} latency "
                f"p50 {np.percentile(lat, 50):.2f} ms p99 {np.percentile(lat, 99):.2f} ms over {len(latencies)} "
                f"samples (target p99 <= {TARGET_P99_MS} ms: {np.percentile(lat, 99) / TARGET_P99_MS:.2f}x)"
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
    parser.add_argument("--consumer-sleep-ms", type=float, default=2.0)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.batches is None:
        args.batches = 10 if args.quick else 40
    print(f"bench_replay: pid {os.getpid()}, {os.cpu_count()} CPUs visible, load avg {os.getloadavg()[0]:.1f}")
    if not args.skip_memory:
        bench_memory(2_000 if args.quick else 10_000, args.prompt_tokens, args.response_tokens)
    bench_actor(args)


if __name__ == "__main__":
    main()
