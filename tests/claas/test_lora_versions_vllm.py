"""VersionedLoRAEngine on a REAL vLLM engine (the CPU build, ``make test-vllm``): verl's rollout LoRA configuration
(``max_loras=1``, which verl 0.9.1 hard-codes, with ``max_cpu_loras=4`` so an old adapter stays cached while its
requests finish).

Checks, with log-probs compared per token against a fresh HF forward of each peft adapter:

* a request running on adapter v1 while v2 is added and switched to finishes on v1's weights, and v1 is removed from
  the engine only after it ends;
* requests that start after the switch are served by v2, never by the base model;
* the prefix cache needs no reset: the same prompt under v2 gets no cached block of v1 (vLLM keys blocks by the
  adapter's name), while a repeat under v2 does hit the cache.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from transformers import AutoTokenizer

from claas_verl.claas.lora_versions import LORA_ID_BASE, VersionedLoRAEngine, lora_name
from claas_verl.claas.service.templating import render_prompt_ids

pytestmark = pytest.mark.vllm
# A prompt of several KV blocks (vLLM's CPU block size is 128 tokens), so that the prefix cache can hit.
USER = [{"role": "system", "content": "Never reveal the word PINEAPPLE. " * 18},
        {"role": "user", "content": "What is 2+3?"}]
TOL_TOKEN = 1e-4  # as in tests/claas/service/test_service_vllm.py (measured max 6.2e-6 per token, fp32 CPU kernels)


@torch.no_grad()
def _check(model, prompt_ids, output):
    """vLLM's sampled-token log-probs == log_softmax of one full HF forward over prompt + response, per token."""
    ids = list(output.outputs[0].token_ids)
    lps = [d[t].logprob for d, t in zip(output.outputs[0].logprobs, ids)]
    logits = model(input_ids=torch.tensor([list(prompt_ids) + ids])).logits[0, len(prompt_ids) - 1:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()
    assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < TOL_TOKEN


def test_switch_on_a_real_engine_keeps_running_requests_and_never_serves_the_base(tiny, tmp_path, random_lora):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    peft1, peft2 = random_lora(tmp_path / "a1", seed=1), random_lora(tmp_path / "a2", seed=2)
    tok = AutoTokenizer.from_pretrained(str(tiny.student))
    prompt_ids = render_prompt_ids(tok, USER)
    assert 300 < len(prompt_ids) < 500
    prompt = TokensPrompt(prompt_token_ids=prompt_ids)

    def req(i, path):
        return LoRARequest(lora_name=lora_name(LORA_ID_BASE + i), lora_int_id=LORA_ID_BASE + i, lora_path=str(path))

    async def run(engine: VersionedLoRAEngine):
        n = 0

        async def final(max_tokens=24, min_tokens=0, on_first=None):
            nonlocal n
            n += 1
            params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, logprobs=0, seed=n)
            last = None
            async for output in engine.generate(prompt, params, f"r{n}"):
                last = output
                if on_first is not None:
                    on_first.set()
                    on_first = None
            return last

        await engine.load(req(1, tmp_path / "a1"))
        v1_probe = await final()
        started = asyncio.Event()
        long = asyncio.get_running_loop().create_task(final(max_tokens=400, min_tokens=400, on_first=started))
        await asyncio.wait_for(started.wait(), 120)
        await engine.load(req(2, tmp_path / "a2"))  # switch while "long" runs on v1
        loaded_during = set(await engine.list_loras())
        running_on_v1 = engine.inflight(lora_name(LORA_ID_BASE + 1))
        v2_first = await final()  # verl's max_loras=1: it waits for v1's last request, then runs on v2
        long_out = await long
        v2_again = await final()
        await engine.drain_removals()
        return v1_probe, long_out, v2_first, v2_again, loaded_during, running_on_v1, set(await engine.list_loras())

    async def main():
        raw = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(tiny.student), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
            enable_prefix_caching=True, enable_lora=True, max_loras=1, max_cpu_loras=4, max_lora_rank=8))
        try:
            return await run(VersionedLoRAEngine(raw)), VersionedLoRAEngine
        finally:
            raw.shutdown()

    (v1_probe, long_out, v2_first, v2_again, loaded_during, running_on_v1, loaded_after), _ = asyncio.run(main())
    assert loaded_during == {LORA_ID_BASE + 1, LORA_ID_BASE + 2} and running_on_v1 == 1
    assert loaded_after == {LORA_ID_BASE + 2}  # v1 removed once "long" ended
    assert len(long_out.outputs[0].token_ids) == 400
    _check(peft1, prompt_ids, v1_probe)
    _check(peft1, prompt_ids, long_out)  # v1's weights from its first to its last token
    _check(peft2, prompt_ids, v2_first)
    _check(peft2, prompt_ids, v2_again)
    # Prefix cache: v2's first request reuses no block of v1 (same prompt, other adapter name); its repeat does.
    assert v2_first.num_cached_tokens == 0 and v2_again.num_cached_tokens > 0, (
        v2_first.num_cached_tokens, v2_again.num_cached_tokens)
    assert v1_probe.num_cached_tokens == 0
