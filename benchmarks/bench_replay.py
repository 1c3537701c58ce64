"""Replay-buffer actor: entries by reference vs by copy vs the no-op Ray floor. Prints figures; not a test.

    python benchmarks/bench_replay.py                       # full run
    python benchmarks/bench_replay.py --quick --json PATH   # ~4x fewer batches; rows also written as JSON
    python benchmarks/bench_replay.py --quick --two-nodes   # adds rounds on two Ray nodes started on this machine

Traffic: 1, 4 and 8 concurrent producer actors each send batches of 50 entries (2,000-token responses plus a
512-token prompt) while the driver, standing in for the trainer, samples M=8 (and holds the full entries: on the
reference path the sample includes ``fetch_entries``, the rows' ray.get from the object store) and calls on_update
in a loop. Three designs, same traffic, one run:

* ``reference``: producers ``put_batch`` (tokens into the object store once) and send a ``RefBatch``; the actor keeps
  EntryRefs and takes ownership of the buffers (batched adopt tasks); samples are served by the actor's consumer
  concurrency group and the rows fetched by the driver. The default of the CLaaS producer and the chat sink.
* ``copy``: the same actor, producers send the tokens inside a ``PackedEntries`` (every token crosses the actor's
  process twice); the path before entries went by reference.
* ``noop``: an actor that does no work, fed like ``copy`` (the copy path's Ray floor; sample returns M prebuilt
  entries).

Figures per round: entries inserted per second and the consumer's sample latency p50/p99 (targets: reference insert
throughput >= 2x the noop floor with 8 producers; sample p99 < 10 ms while 4 producers add). Also printed: the
actor's own CPU per batch without Ray (copy vs reference header), the producers' put_batch cost, and the memory of a
plain ReplayBuffer holding 10,000 copied entries.

``--two-nodes`` starts a two-node Ray cluster on this machine (``ray start --block`` twice, under
``--temp-dir=/tmp/ray_replayref``, with its own resources, stopped by PID at the end): the actor and the driver on
the head node, every producer on the second node, so rows and arguments cross the object managers as between
machines. Producer, consumer and actor processes share the machine's cores, so on a machine that other jobs load the
figures are lower bounds; the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pickle
import socket
import subprocess
import sys
import time

import numpy as np
import ray

from claas_verl.claas.replay import (
    BatchHandle,
    PackedEntries,
    RefBatch,
    ReplayBuffer,
    ReplayEntry,
    fetch_entries,
    make_replay_actor,
    put_batch,
)

TARGET_P99_MS = 10.0
TARGET_FLOOR_RATIO = 2.0
TEMP_DIR = "/tmp/ray_replayref"


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
    """Sends one prebuilt batch over and over with fresh uids: by reference (``put_batch``: validate + one
    ``ray.put`` of the token buffer per batch, as the CLaaS producer does) or by copy (the PackedEntries itself)."""

    def __init__(self, pid: int, batch: int, prompt_tokens: int, response_tokens: int):
        self.pid = pid
        self.packed = PackedEntries.from_entries(
            make_batch(np.random.default_rng(pid), batch, prompt_tokens, response_tokens, f"p{pid}"))

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def run(self, buffer, n_batches: int, round_id, inflight: int, by_ref: bool) -> dict:
        """Send n_batches, keeping at most ``inflight`` adds unacknowledged (1 = wait for each)."""
        accepted, pending, put_s = 0, [], 0.0
        n = len(self.packed)
        for b in range(n_batches):
            batch = dataclasses.replace(self.packed, uid=tuple(f"r{round_id}-p{self.pid}-b{b}-{i}" for i in range(n)))
            if by_ref:
                t0 = time.perf_counter()
                batch = put_batch(batch)
                put_s += time.perf_counter() - t0
            pending.append(buffer.add.remote(batch))
            del batch  # the actor owns what it keeps; the producer holds nothing
            if len(pending) >= inflight:
                accepted += ray.get(pending.pop(0))
        return {"accepted": accepted + sum(ray.get(pending)), "put_s": put_s, "batches": n_batches}


@ray.remote(num_cpus=0)
class NoOpBuffer:
    """The copy path's Ray floor: same calls as the replay actor, no work (add counts, sample returns a prebuilt
    list of M entries, so the sample moves the same bytes as the copy design's)."""

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

    async def pid(self) -> int:
        return os.getpid()


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
        batch = make_batch(rng, min(50, n_entries - start), prompt_tokens, response_tokens, f"m{start}")
        buf.add(PackedEntries.from_entries(batch))
    gc.collect()
    grown = rss_bytes() - before
    token_bytes = buf.stats()["stored_nbytes"]
    scale = 10_000 / n_entries
    print(f"memory of a plain ReplayBuffer by copy, per 10,000 entries: RSS {grown * scale / 2**20:.1f} MiB, token "
          f"arrays {token_bytes * scale / 2**20:.1f} MiB, overhead {(grown - token_bytes) / n_entries:.0f} B/entry "
          "(by reference the actor holds only the overhead; the tokens sit in the object store)")


def bench_actor_cpu(args) -> None:
    """The actor's own serial cost per batch, without Ray: unpickle (protocol 5, out-of-band buffers, as Ray does)
    plus ``ReplayBuffer.add``, with a sample and an update every 4th batch; for the copy path (PackedEntries) and
    the reference path (RefBatch header; a placeholder stands in for the ObjectRef). Its inverse is the ceiling the
    actor's own code sets on one core."""
    template = PackedEntries.from_entries(
        make_batch(np.random.default_rng(0), args.batch, args.prompt_tokens, args.response_tokens, "cpu"))
    n = 200
    for fmt in ("copy", "reference"):
        wire = []
        for b in range(n):
            packed = dataclasses.replace(template, uid=tuple(f"{fmt}-{b}-{i}" for i in range(len(template))))
            obj = packed if fmt == "copy" else RefBatch(
                handle=BatchHandle(f"ref-{b}", packed.tokens.shape[0], "node"), columns=packed.without_tokens())
            buffers: list = []
            wire.append((pickle.dumps(obj, protocol=5, buffer_callback=buffers.append), buffers))
        buf = ReplayBuffer(b_max=1000, b_min=8, a_max=5, seed=0)
        t0 = time.perf_counter()
        for b, (data, buffers) in enumerate(wire):
            buf.add(pickle.loads(data, buffers=buffers))
            if b % 4 == 3:
                pickle.dumps(buf.sample(args.m), protocol=5, buffer_callback=lambda _: None)
                buf.on_update()
        per_batch = (time.perf_counter() - t0) / n
        print(f"actor CPU per batch of {args.batch} ({fmt}): {per_batch * 1e3:.3f} ms (unpickle + add, amortised "
              f"sample+pickle/update) -> ceiling {args.batch / per_batch:,.0f} entries/s on one core")


class CpuMeter:
    """CPU seconds spent by the driver and its descendant processes (the local Ray cluster: gcs, raylet, workers),
    grouped as actor / producers / driver / raylet / other (gcs, the adopter, idle workers). One node only."""

    def __init__(self, actor_pids: set, producer_pids: set):
        import psutil

        self.psutil = psutil
        self.groups = {"actor": actor_pids, "producers": producer_pids, "driver": {os.getpid()}}

    def _group(self, proc) -> str:
        for name, pids in self.groups.items():
            if proc.pid in pids:
                return name
        try:
            return "raylet" if "raylet" in proc.name() else "other"
        except self.psutil.Error:
            return "other"

    def sample(self) -> dict:
        out: dict = {}
        me = self.psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                out[proc.pid] = (self._group(proc), t.user + t.system)
            except self.psutil.Error:
                pass
        return out

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        groups: dict = {}
        for pid, (group, cpu) in after.items():
            groups[group] = groups.get(group, 0.0) + cpu - before.get(pid, (group, 0.0))[1]
        return groups


def run_round(design: str, actor, producers, n_prod: int, args, round_id: int, meter=None) -> dict:
    """n_prod producers add while the driver samples M (and, by reference, fetches the rows) and calls
    on_update; return the round's figures."""
    by_ref = design == "reference"
    cpu0 = meter.sample() if meter else None
    refs = [p.run.remote(actor, args.batches, f"{design}{round_id}", args.inflight, by_ref) for p in producers[:n_prod]]
    t0 = time.perf_counter()
    latencies, call_latencies = [], []  # the whole sample (rows in hand), and the actor call alone
    while True:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(done) == len(refs):
            break
        s0 = time.perf_counter()  # one round trip: wait (0 s if ready), sample, and the rows in hand
        drawn = ray.get(actor.sample_when_ready.remote(args.m, 1.0))
        s1 = time.perf_counter()
        got = fetch_entries(drawn)
        del drawn
        if got is not None:
            latencies.append((time.perf_counter() - s0) * 1e3)
            call_latencies.append((s1 - s0) * 1e3)
            assert len(got) == args.m and got[0].response_ids.shape[0] == args.response_tokens
            del got
            ray.get(actor.on_update.remote())
        time.sleep(args.consumer_sleep_ms / 1e3)
    elapsed = time.perf_counter() - t0
    results = ray.get(refs)
    accepted = sum(r["accepted"] for r in results)
    sent = n_prod * args.batches * args.batch
    assert accepted == sent, f"{design}: {accepted} of {sent} entries accepted (uids must be unique per round)"
    put_ms = 1e3 * sum(r["put_s"] for r in results) / max(1, sum(r["batches"] for r in results))
    lat = np.array(latencies) if latencies else np.array([np.nan])
    n_batches = sum(r["batches"] for r in results)
    cpu = {g: 1e3 * v / n_batches for g, v in meter.delta(cpu0, meter.sample()).items()} if meter else {}
    return {"design": design, "producers": n_prod, "entries_per_s": accepted / elapsed,
            "sample_p99_ms": float(np.percentile(lat, 99)), "sample_p50_ms": float(np.percentile(lat, 50)),
            "sample_call_p99_ms": float(np.percentile(call_latencies or [np.nan], 99)),
            "samples": len(latencies), "accepted": accepted, "put_ms_per_batch": put_ms, "cpu_ms_per_batch": cpu}


def bench_designs(args, nodes: int, producer_options: dict) -> list[dict]:
    actor = make_replay_actor(b_max=1000, b_min=8, a_max=5, seed=0, max_restarts=0, adopt=not args.no_adopt)
    noop = NoOpBuffer.remote(args.m, args.prompt_tokens, args.response_tokens)
    producers = [
        Producer.options(**producer_options).remote(p, args.batch, args.prompt_tokens, args.response_tokens)
        for p in range(max(args.producers))
    ]
    ray.get([p.ping.remote() for p in producers] + [actor.size.remote(), noop.size.remote()])  # start-up
    meter = None
    if nodes == 1:
        actor_pids = {ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), ray.get(noop.pid.remote())}
        meter = CpuMeter(actor_pids, set(ray.get([p.pid.remote() for p in producers])))
    for target, by_ref in ((actor, True), (actor, False), (noop, False)):
        ray.get(producers[0].run.remote(target, 2, -1 - by_ref, 1, by_ref))  # warm-up
    # ... including the adopter actor the replay actor starts on first adoption (fetching waits for it), then one
    # unrecorded round per design: the first rounds pay for worker start-ups and imports
    fetch_entries(ray.get(actor.sample_when_ready.remote(args.m, 120.0)))
    ray.get(actor.on_update.remote())
    warm = argparse.Namespace(**{**vars(args), "batches": 3})
    for design in args.designs:
        run_round(design, noop if design == "noop" else actor, producers, max(args.producers), warm, -10)
    rows = []
    for round_id, n_prod in enumerate(args.producers):
        by_design = {}
        for design in args.designs:
            r = run_round(design, noop if design == "noop" else actor, producers, n_prod, args, round_id, meter)
            r["nodes"] = nodes
            by_design[design] = r
            rows.append(r)
            put = f", put_batch {r['put_ms_per_batch']:.2f} ms/batch in the producer" if design == "reference" else ""
            print(f"  [{nodes} node{'s' if nodes > 1 else ''}] {design:9s} producers={n_prod}: "
                  f"{r['entries_per_s']:8,.0f} entries/s; sample M={args.m} p50 {r['sample_p50_ms']:6.2f} ms "
                  f"p99 {r['sample_p99_ms']:6.2f} ms (actor call alone p99 {r['sample_call_p99_ms']:6.2f}) over "
                  f"{r['samples']} samples{put}")
            if r["cpu_ms_per_batch"]:
                c = r["cpu_ms_per_batch"]
                print("      CPU ms per batch: " + ", ".join(f"{g} {c.get(g, 0.0):.2f}" for g in
                      ("producers", "actor", "driver", "raylet", "other")) + f" (total {sum(c.values()):.2f})")
        if "noop" in by_design:
            floor = by_design["noop"]["entries_per_s"]
            print("    -> vs the noop floor: " + ", ".join(
                f"{d} {by_design[d]['entries_per_s'] / floor:.2f}x" for d in by_design if d != "noop"))
            c = by_design["noop"]["cpu_ms_per_batch"]
            if c and sum(c.values()) > c.get("actor", 0.0):
                # When the cores are the bottleneck, an actor that cost nothing would save only the noop actor's
                # own CPU: the rest (producers' puts, raylet, driver) stays. This bounds any design's gain.
                bound = sum(c.values()) / (sum(c.values()) - c.get("actor", 0.0))
                print(f"    -> CPU-bound ceiling of ANY actor design over the noop floor here: {bound:.2f}x "
                      f"(noop round: {sum(c.values()):.2f} ms CPU per batch, actor {c.get('actor', 0):.2f})")
    s = ray.get(actor.stats.remote())
    print(f"  actor stats: size={s['size']} inserted={s['inserted']} evicted_fifo={s['evicted_fifo']} "
          f"evicted_age={s['evicted_age']} updates={s['update_count']} max_uses={s['max_uses']} "
          f"ref_batches={s['ref_batches']} adopted={s['adopted_batches']} adopt_errors={s['adopt_errors']}")
    for h in [actor, noop, *producers]:
        ray.kill(h)
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_nodes(object_store_bytes: int) -> tuple[str, list]:
    """Two Ray nodes on this machine under TEMP_DIR (never the default temp dir, so nobody else's ray.init joins
    them). ``ray start --block`` stays in the foreground and tears its node down when terminated."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--num-cpus=1", f"--object-store-memory={object_store_bytes}", "--disable-usage-stats"]
    head = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", f"--temp-dir={TEMP_DIR}",
                             "--include-dashboard=false", '--resources={"node_a": 1000}', *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [head]
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or head.poll() is not None:
                raise RuntimeError("the head node did not start") from None
            time.sleep(0.5)
    time.sleep(2)
    procs.append(subprocess.Popen([ray_bin, "start", f"--address={address}", '--resources={"node_b": 1000}',
                                   *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return address, procs


def stop_nodes(procs: list) -> None:
    for p in reversed(procs):  # only the processes this script started, by PID
        p.terminate()
    for p in reversed(procs):
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and a smaller memory probe")
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--designs", nargs="+", choices=("reference", "copy", "noop"),
                        default=["reference", "copy", "noop"])
    parser.add_argument("--batches", type=int, default=None, help="batches per producer (default 40, quick 10)")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--response-tokens", type=int, default=2000)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--consumer-sleep-ms", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=1,
                        help="adds a producer keeps unacknowledged (1: each waits for its ack; an asynchronous "
                             "producer such as the chat service's sink does not wait at all)")
    parser.add_argument("--two-nodes", action="store_true", help="also run every round on two local Ray nodes")
    parser.add_argument("--no-adopt", action="store_true",
                        help="the actor leaves the buffers owned by their producers (no adoption copy)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", default=None, help="write the rows (design, producers, entries_per_s, "
                                                     "sample_p99_ms, ...) to this path")
    args = parser.parse_args()
    if args.batches is None:
        args.batches = 10 if args.quick else 40
    print(f"bench_replay: pid {os.getpid()}, {os.cpu_count()} CPUs visible, load avg "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, batches of {args.batch} entries "
          f"({args.prompt_tokens}+{args.response_tokens} tokens), {args.batches} per producer, "
          f"{args.inflight} in flight each")
    if not args.skip_memory:
        bench_memory(2_000 if args.quick else 10_000, args.prompt_tokens, args.response_tokens)
    bench_actor_cpu(args)
    rows = []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print("one node (ray.init, 2 CPUs):")
        rows += bench_designs(args, 1, {})
    finally:
        ray.shutdown()
    if args.two_nodes:
        address, procs = start_two_nodes(1 << 30)
        try:
            ray.init(address=address, log_to_driver=False)
            print("two nodes on this machine (actor + driver on the head node, producers on the other):")
            rows += bench_designs(args, 2, {"resources": {"node_b": 1}})
        finally:
            ray.shutdown()
            stop_nodes(procs)
    print(f"load avg at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n| nodes | producers | design | entries/s | x noop | sample p50 ms | sample p99 ms | call p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        floor = next((f["entries_per_s"] for f in rows if f["design"] == "noop" and f["nodes"] == r["nodes"]
                      and f["producers"] == r["producers"]), float("nan"))
        print(f"| {r['nodes']} | {r['producers']} | {r['design']} | {r['entries_per_s']:,.0f} | "
              f"{r['entries_per_s'] / floor:.2f} | {r['sample_p50_ms']:.2f} | {r['sample_p99_ms']:.2f} | "
              f"{r['sample_call_p99_ms']:.2f} |")
    for nodes in sorted({r["nodes"] for r in rows}):
        get = {(r["design"], r["producers"]): r for r in rows if r["nodes"] == nodes}
        if ("reference", 8) in get and ("noop", 8) in get:
            ratio = get[("reference", 8)]["entries_per_s"] / get[("noop", 8)]["entries_per_s"]
            print(f"target [{nodes} node(s)]: reference insert throughput with 8 producers = {ratio:.2f}x the noop "
                  f"floor (target >= {TARGET_FLOOR_RATIO}x): {'met' if ratio >= TARGET_FLOOR_RATIO else 'MISSED'}")
        if ("reference", 4) in get:
            p99 = get[("reference", 4)]["sample_p99_ms"]
            print(f"target [{nodes} node(s)]: reference sample p99 with 4 producers = {p99:.2f} ms (target < "
                  f"{TARGET_P99_MS} ms): {'met' if p99 < TARGET_P99_MS else 'MISSED'}")
    if args.json:
        keep = ("design", "producers", "entries_per_s", "sample_p99_ms", "sample_p50_ms", "sample_call_p99_ms", "nodes")
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in keep} for r in rows], f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
