"""Token streaming of the chat API: time to the first content chunk against the whole reply, over real HTTP with the
``openai`` client, for the in-process HF backend (tiny model, CPU) and, with ``--vllm``, a real vLLM server
(``.venv-vllm/bin/python benchmarks/bench_service_streaming.py --vllm``; the CPU build here, a CUDA build on GPUs).

For each backend it runs ``--runs`` streamed replies of exactly ``--tokens`` tokens (EOS off: the HF backend's EOS set
is emptied, vLLM gets ``min_tokens``) and prints the median time to the first content chunk (TTFC), the median total
time, their ratio (target: well below 1; a backend that buffers the reply has a ratio near 1), and the number of
content chunks per reply (one per token for a token-by-token stream).

    python benchmarks/bench_service_streaming.py [--tokens 128] [--runs 5] [--vllm]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "service"))

USER = [{"role": "user", "content": "Tell me about the sea."}]


def measure(url: str, tokens: int, runs: int, extra: dict) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    client.chat.completions.create(model="claas", messages=USER, max_tokens=2,  # warm-up, not recorded
                                   extra_body={"metadata": {"record": False}})
    ttfc, total, chunks = [], [], []
    for seed in range(runs):
        t0 = time.perf_counter()
        first, n = None, 0
        stream = client.chat.completions.create(model="claas", messages=USER, max_tokens=tokens, seed=seed,
                                                stream=True, extra_body={"metadata": {"record": False}, **extra})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                n += 1
                first = first if first is not None else time.perf_counter() - t0
        total.append(time.perf_counter() - t0)
        ttfc.append(first if first is not None else float("nan"))
        chunks.append(n)
    return {"ttfc": statistics.median(ttfc), "total": statistics.median(total), "chunks": statistics.median(chunks)}


def report(name: str, tokens: int, m: dict) -> None:
    print(f"{name}: {tokens} tokens, TTFC median {m['ttfc'] * 1000:.1f} ms, total median {m['total'] * 1000:.1f} ms, "
          f"TTFC/total {m['ttfc'] / m['total']:.3f}, content chunks per reply {m['chunks']:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vllm", action="store_true", help="also measure a real vLLM server (needs vLLM installed)")
    args = ap.parse_args()

    import torch
    from service_helpers import big_buffer, running_service

    from claas_verl.claas.service import HFBackend
    from claas_verl.tiny import ensure_tiny

    torch.set_num_threads(1)
    tiny = ensure_tiny()
    hf = HFBackend(tiny.student, default_max_tokens=args.tokens, seed=0)
    hf.eos_token_ids = set()  # exactly --tokens tokens per reply
    with running_service(hf, big_buffer()) as (_, url):
        report("HF backend (tiny, CPU)", args.tokens, measure(url, args.tokens, args.runs, {}))
    if args.vllm:
        from claas_verl.claas.service import OpenAIBackend
        from claas_verl.claas.service.vllm_launcher import VLLMServer

        with VLLMServer(tiny.student, served_model_name="tiny", max_model_len=2048) as server:
            backend = OpenAIBackend(server.url, "tiny", api_key=server.api_key)
            with running_service(backend, big_buffer()) as (_, url):
                report("vLLM OpenAI backend (tiny)", args.tokens,
                       measure(url, args.tokens, args.runs, {"min_tokens": args.tokens}))


if __name__ == "__main__":
    main()
