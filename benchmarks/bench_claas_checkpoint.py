"""Cost of the CLaaS part of a checkpoint (what resume adds to verl's own): buffer snapshot + state.json, and load.

    python benchmarks/bench_claas_checkpoint.py            # B_max = 1000 entries (the paper's), 1024 + 1024 tokens
    python benchmarks/bench_claas_checkpoint.py --quick    # 200 entries

Runs the replay-buffer actor's body (``AsyncReplayBuffer``) in one asyncio loop: ``save`` (the atomic snapshot the
trainer's checkpoint writes, producers' commits paused meanwhile), ``summary`` (k and the uids state.json records),
``resume.save_state``, then ``resume.load_state`` + ``load`` into a fresh buffer. Prints seconds, MB and MB/s; the
pause of the producers' commits lasts the save + summary + state time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import numpy as np


def main() -> None:
    from claas_verl.claas.replay import AsyncReplayBuffer, ReplayEntry
    from claas_verl.claas.trainer import resume as rs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 entries instead of 1000")
    parser.add_argument("--entries", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--response-tokens", type=int, default=1024)
    args = parser.parse_args()
    n = args.entries or (200 if args.quick else 1000)
    rng = np.random.default_rng(0)
    entries = [ReplayEntry(scenario_id=i // 4, step_idx=i % 4,
                           prompt_ids=rng.integers(0, 150_000, args.prompt_tokens).tolist(),
                           response_ids=rng.integers(0, 150_000, args.response_tokens).tolist(),
                           behaviour_logprob=-12.5, reward=float(i % 2), P=0) for i in range(n)]
    ident = {k: None for k in rs.IDENTITY_KEYS}

    async def run() -> dict:
        buf = AsyncReplayBuffer(b_max=n, b_min=8, a_max=25, seed=0, adopt=False)
        await buf.add(entries)
        with tempfile.TemporaryDirectory() as tmp:
            claas_dir = os.path.join(tmp, "global_step_1", rs.CLAAS_DIR)
            os.makedirs(claas_dir)
            await buf.on_update()
            name = rs.new_buffer_file()
            t0 = time.perf_counter()
            await buf.save(os.path.join(claas_dir, name))
            t_save = time.perf_counter() - t0
            summary = await buf.summary()
            state = rs.ClaasState(global_steps=1, updates=1, config=ident, position=rs.StreamPosition(0, [0, 1]),
                                  buffer={"file": name, **summary})
            rs.save_state(claas_dir, state)
            t_capture = time.perf_counter() - t0
            size = os.path.getsize(os.path.join(claas_dir, name))
            t0 = time.perf_counter()
            loaded = rs.load_state(claas_dir, ident, global_steps=1)
            fresh = AsyncReplayBuffer(b_max=n, b_min=8, a_max=25, seed=1, adopt=False)
            await fresh.load(os.path.join(claas_dir, loaded.buffer["file"]))
            t_load = time.perf_counter() - t0
            assert (await fresh.summary())["uids"] == summary["uids"]
        return {"save_s": t_save, "capture_s": t_capture, "load_s": t_load, "mb": size / 2**20}

    r = asyncio.run(run())
    print(f"entries={n} tokens/entry={args.prompt_tokens + args.response_tokens} snapshot={r['mb']:.1f} MB")
    print(f"capture (snapshot + summary + state.json, commits paused): {r['capture_s']:.3f} s "
          f"(snapshot {r['save_s']:.3f} s, {r['mb'] / r['save_s']:.0f} MB/s)")
    print(f"resume (state.json check + snapshot load + validation): {r['load_s']:.3f} s "
          f"({r['mb'] / r['load_s']:.0f} MB/s)")


if __name__ == "__main__":
    main()
