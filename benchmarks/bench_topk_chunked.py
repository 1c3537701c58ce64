"""Time and peak memory of the chunked top-k log-prob forward + backward vs the number of tokens.

    python benchmarks/bench_topk_chunked.py            # V = 151,936, N = 1k, 2k, 4k, 8k tokens, bf16 logits
    python benchmarks/bench_topk_chunked.py --quick    # N = 512 .. 4k
    python benchmarks/bench_topk_chunked.py --legacy   # + the former per-chunk checkpoint path (quadratic)

Each N runs in a fresh subprocess: ``logits [N, V]`` (bf16, a leaf that needs a gradient, standing in for the
lm_head output; a hidden size of 0, i.e. no projection, since the issue is the log-prob path itself),
``topk_distill_loss`` with κ = 16 and chunk 1024, then ``backward()``. Peak memory is the process's peak resident
set (``ru_maxrss``) minus its resident set just before the logits were allocated, so it includes the logits
themselves (2·N·V bytes) and their gradient (2·N·V bytes); the rest is the chunk temporaries. Time is the median
CPU time of ``--reps`` forward + backward passes after one warm-up. Target: 4x tokens -> at most ~4.5x time and
memory.

``--legacy`` re-runs the path this replaced (each chunk of the flat ``[N, V]`` tensor under
``torch.utils.checkpoint``: every chunk's backward allocates and adds a zero ``[N, V]`` gradient), to show the
quadratic growth it had.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

V = 151_936
K = 16
CHUNK = 1024


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _legacy_logprobs(logits, ids, chunk):
    from torch.utils.checkpoint import checkpoint

    def part(z, i):
        z = z.float()
        return torch.gather(z, -1, i) - torch.logsumexp(z, -1, keepdim=True)

    B, T, Vv = logits.shape
    flat, fi = logits.reshape(B * T, Vv), ids.reshape(B * T, -1)
    parts = [checkpoint(part, flat[s:s + chunk], fi[s:s + chunk], use_reentrant=False)
             for s in range(0, B * T, chunk)]
    return torch.cat(parts).view(B, T, -1)


def child(n: int, reps: int, legacy: bool) -> dict:
    from claas_verl.distill import topk_distill_loss, topk_distill_loss_from_logprobs

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, n, K), generator=g)
    adv = torch.randn(1, n, K, generator=g)
    mask = torch.ones(1, n)
    base = _rss_kib()
    logits = torch.empty(1, n, V, dtype=torch.bfloat16)
    logits.normal_(generator=g).requires_grad_(True)

    def step():
        logits.grad = None
        if legacy:
            loss = topk_distill_loss_from_logprobs(_legacy_logprobs(logits, ids, CHUNK), adv, mask)
        else:
            loss = topk_distill_loss(logits, ids, adv, mask, chunk_size=CHUNK)
        loss.backward()

    times = []
    for i in range(reps + 1):
        t0 = time.process_time()
        step()
        if i:
            times.append(time.process_time() - t0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"n": n, "time_s": statistics.median(times), "peak_mib": (peak_kib - base) / 1024,
            "logits_mib": n * V * 2 / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--legacy", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--child", type=int, default=0)
    ap.add_argument("--child-legacy", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps, args.child_legacy)))
        return
    ns = [512, 1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192]
    variants = [("chunked (this code)", False)] + ([("legacy checkpoint", True)] if args.legacy else [])
    print(f"topk_distill_loss forward+backward, V={V}, K={K}, chunk={CHUNK}, bf16 logits, 1 thread, CPU time")
    for name, legacy in variants:
        rows = []
        for n in ns:
            if legacy and n > 4096:
                continue
            cmd = [sys.executable, __file__, "--child", str(n), "--reps", str(args.reps)]
            cmd += ["--child-legacy"] if legacy else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"\n{name}")
        print(f"{'N':>6} {'time s':>8} {'peak MiB':>9} {'logits MiB':>10} {'time x':>7} {'mem x':>6}")
        for i, r in enumerate(rows):
            tx = r["time_s"] / rows[i - 1]["time_s"] if i else float("nan")
            mx = r["peak_mib"] / rows[i - 1]["peak_mib"] if i else float("nan")
            print(f"{r['n']:>6} {r['time_s']:>8.2f} {r['peak_mib']:>9.0f} {r['logits_mib']:>10.0f} "
                  f"{tx:>7.2f} {mx:>6.2f}")
        if len(rows) >= 3:
            t4 = rows[-1]["time_s"] / rows[-3]["time_s"]
            m4 = rows[-1]["peak_mib"] / rows[-3]["peak_mib"]
            ok = "meets" if max(t4, m4) <= 4.5 else "MISSES"
            print(f"4x tokens ({rows[-3]['n']} -> {rows[-1]['n']}): time x{t4:.2f}, peak memory x{m4:.2f} "
                  f"({ok} the <= 4.5x target)")


if __name__ == "__main__":
    main()
