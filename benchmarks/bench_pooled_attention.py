"""Peak memory and time of chunked (recomputed) vs naive pooled attention rows, forward + backward (docs/math.md §B.4).

    python benchmarks/bench_pooled_attention.py --quick        # ~1 min on 2 CPU cores
    python benchmarks/bench_pooled_attention.py --device cuda  # GPU peak from torch.cuda memory stats

Memory (CPU): the process's resident high-water mark is reset through ``/proc/self/clear_refs`` before each
forward+backward and read back from ``VmHWM`` after it; glibc is first told (``mallopt``) to hand every block
over 64 KiB straight back to the OS when freed, so the resident peak tracks the live tensors instead of heap
reuse. On CUDA: ``torch.cuda.max_memory_allocated``. "saved" is the exact number of bytes autograd keeps for
backward (distinct storages, via saved_tensors_hooks). Time: best of the repetitions after one warm-up step,
measured after the memory pass with heap reuse restored.
Setup: one response of W window tokens after a 256-token prompt, H=4 query heads, G=2 KV heads,
d=64, and a fixed 16 regions per response, so the pooled output itself is linear in the key count.
Target: chunked memory grows linearly in W, naive quadratically.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from claas_verl.align import naive_pooled_attention_rows, pooled_attention_rows

PROMPT, H, G, D, REGIONS = 256, 4, 2, 64, 16


def _inputs(w: int, device: str):
    gen = torch.Generator().manual_seed(0)
    t = PROMPT + w
    q = torch.randn(1, H, t, D, generator=gen).to(device).requires_grad_()
    k = torch.randn(1, G, t, D, generator=gen).to(device).requires_grad_()
    key_mask = torch.ones(1, t, dtype=torch.long, device=device)
    rid = torch.full((1, t), -1, dtype=torch.long)
    rid[0, PROMPT:] = torch.arange(w) * REGIONS // w  # 16 equal regions over the window
    return q, k, key_mask, rid.to(device), torch.tensor([REGIONS], device=device)


def _step(method: str, args, chunk: int):
    fn = naive_pooled_attention_rows if method == "naive" else pooled_attention_rows
    kw = {} if method == "naive" else {"chunk_size": chunk}
    out = fn(*args, **kw).rows
    out.pow(2).sum().backward()


def _rss_peak_reset() -> int:
    """Reset the resident high-water mark to the current resident size and return it (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_peak()


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM missing from /proc/self/status")


def memory(method: str, w: int, chunk: int, device: str) -> dict:
    """Peak memory of one forward+backward above the inputs, and the bytes autograd saves for backward."""
    args = _inputs(w, device)
    saved: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return x

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_peak_reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        _step(method, args, chunk)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_peak() - base
    return {"peak": peak, "saved": sum(saved.values())}


def timing(method: str, w: int, chunk: int, reps: int, device: str) -> float:
    args = _inputs(w, device)
    times = []
    for _ in range(reps + 1):  # the first step is a warm-up
        args[0].grad = args[1].grad = None
        t0 = time.perf_counter()
        _step(method, args, chunk)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one timed repetition per point (default 3)")
    ap.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 2000])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    reps = 1 if a.quick else 3
    points = [(m, w) for m in ("chunked", "naive") for w in a.windows]
    libc = ctypes.CDLL("libc.so.6") if a.device == "cpu" else None
    if libc is not None:
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed large blocks leave the RSS at once
    for m in ("chunked", "naive"):  # warm-up: one-time lazy initialisation must not count as the first peak
        memory(m, 64, a.chunk, a.device)
    res = {p: memory(*p, a.chunk, a.device) for p in points}
    if libc is not None:
        libc.mallopt(-3, 32 * 2**20)  # back to heap reuse for timing (mmap per block adds page faults)
    for p in points:
        res[p]["time"] = timing(*p, a.chunk, reps, a.device)
    mib = 2**20
    print(f"pooled attention rows, fwd+bwd: prompt {PROMPT}, H={H}, G={G}, d={D}, {REGIONS} regions, "
          f"chunk {a.chunk}, device {a.device}")
    print(f"{'W':>6} {'method':>8} {'peak MiB':>9} {'saved MiB':>10} {'time s':>8}")
    for w in a.windows:
        for method in ("chunked", "naive"):
            r = res[method, w]
            print(f"{w:>6} {method:>8} {r['peak'] / mib:>9.1f} {r['saved'] / mib:>10.2f} {r['time']:>8.3f}")
    w0, w1 = a.windows[0], a.windows[-1]
    lin = (PROMPT + w1) / (PROMPT + w0)  # sequence length T = prompt + W: keys of every row
    print(f"growth {w0}->{w1}: T x{lin:.2f} (linear), T^2 x{lin**2:.2f} (quadratic: the naive [T, T] matrix)")
    for method in ("chunked", "naive"):
        r0, r1 = res[method, w0], res[method, w1]
        print(f"  {method:>8}: peak x{r1['peak'] / max(r0['peak'], 1):.2f}  saved x{r1['saved'] / r0['saved']:.2f}  "
              f"time x{r1['time'] / r0['time']:.2f}")
    c, n = res["chunked", w1], res["naive", w1]
    print(f"at W={w1}: chunked/naive peak {c['peak'] / max(n['peak'], 1):.3f}, saved {c['saved'] / n['saved']:.4f}, "
          f"time {c['time'] / n['time']:.2f}")


if __name__ == "__main__":
    main()
