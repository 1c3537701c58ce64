"""The CPU ``hf`` rollout server decoding concurrent requests one at a time vs as one batch.

    python benchmarks/bench_hf_rollout.py                          # the gym bundle's student, 64 requests x 40 tokens
    python benchmarks/bench_hf_rollout.py --requests 64 --tokens 8 --model DIR

Both sides are the same ``HFRolloutServer`` (``claas_verl/verl_ext/cpu/hf_rollout.py``) in-process, given the same
``--requests`` concurrent ``generate`` calls (prompts of unequal length, ``--tokens`` reply tokens each, EOS ignored
so that every reply has that length): ``engine_kwargs.hf.max_batch_size=1`` (the default) decodes each request
alone, ``max_batch_size=--requests`` decodes whatever is queued as one batch. Each side runs ``--repeats`` times;
the fastest run is reported. The script also checks that both sides sampled the same tokens (each request draws
from its own generator, whatever its batch).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_server(model_dir: str, max_batch_size: int, tokens: int):
    from claas_verl.verl_ext.cpu.hf_rollout import HFRolloutServer

    cfg = SimpleNamespace(max_model_len=1024, response_length=tokens, prompt_length=512, seed=0,
                          engine_kwargs={"hf": {"max_batch_size": max_batch_size}}, tensor_model_parallel_size=1,
                          data_parallel_size=1, pipeline_model_parallel_size=1)
    model_cfg = SimpleNamespace(local_path=model_dir, trust_remote_code=False, tokenizer=None)
    return HFRolloutServer(cfg, model_cfg)


def decode_once(server, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    params = {"temperature": 1.0, "ignore_eos": True, "max_tokens": tokens}

    async def run():
        await server.set_global_steps(1)  # the same per-request generators on every run
        return await asyncio.gather(*[server.generate(p, params, f"r{i}") for i, p in enumerate(prompts)])

    start = time.perf_counter()
    outs = asyncio.run(run())
    return time.perf_counter() - start, [o.token_ids for o in outs]


def main() -> None:
    from claas_verl.tiny import gym

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the gym bundle's student)")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests (the gym recipes: 16 x 4)")
    ap.add_argument("--tokens", type=int, default=40, help="reply tokens per request (the gym recipes: at most 40)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = args.model or str(gym.ensure_gym().student)
    # prompts of 20-35 tokens (unequal: the batch is left-padded), ids inside the byte tokenizer's range
    prompts = [[5 + (i + j) % 200 for j in range(20 + i % 16)] for i in range(args.requests)]
    rows = {}
    for label, max_batch_size in (("alone", 1), ("batched", args.requests)):
        server = make_server(model, max_batch_size, args.tokens)
        runs = [decode_once(server, prompts, args.tokens)]
        batches = len(server.get_batch_sizes())
        runs += [decode_once(server, prompts, args.tokens) for _ in range(args.repeats - 1)]
        rows[label] = (min(t for t, _ in runs), runs[0][1], batches)
    same = rows["alone"][1] == rows["batched"][1]
    print(f"{args.requests} requests x {args.tokens} tokens, {os.cpu_count()} CPUs, fastest of {args.repeats} runs")
    print("| decoding | seconds | reply tokens / s | batches (first run) |")
    print("|---|---:|---:|---|")
    for label, (seconds, _, batches) in rows.items():
        print(f"| {label} | {seconds:.3f} | {args.requests * args.tokens / seconds:.0f} | {batches} |")
    print(f"\nalone / batched: {rows['alone'][0] / rows['batched'][0]:.1f}x; same tokens on both sides: {same}")
    if not same:
        raise SystemExit("the batched server sampled other tokens than the one-at-a-time server")


if __name__ == "__main__":
    main()
