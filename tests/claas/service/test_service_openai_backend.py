"""OpenAIBackend against a fake OpenAI-compatible server on loopback that stands in for vLLM (the real one runs in
``make test-vllm``, tests/claas/service/test_service_vllm.py).

The fake answers like vLLM with ``logprobs=true, return_token_ids=true``: prompt ids, response ids incl. EOS and one
log-prob per sampled token, with values that are exact binary fractions so sums can be compared exactly. With
``stream=true`` it sends vLLM 0.30's chunks: the role chunk with ``prompt_token_ids``, one chunk per token with its
``token_ids`` and log-probs (EOS with an empty delta and the finish reason), ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from service_helpers import ADMIN, USER, big_buffer, running_service, wait_until

from claas_verl.claas.service import ClaasServiceClient, OpenAIBackend
from claas_verl.claas.service.server import ServiceThread
from claas_verl.tiny import ensure_tiny

PROMPT_IDS = [1, 5, 9, 2]
RESPONSE_IDS = [40, 41, 2]  # 2 = EOS, part of the response
LOGPROBS = [-0.5, -0.25, -0.125]  # Σ = -0.875 exactly
PIECES = ["Fi", "ve.", ""]  # the visible text of each response token ("Five."; EOS has none)


class FakeVLLM:
    """Records every request; ``gate`` (when set to a cleared Event) holds chat replies until it is set."""

    def __init__(self):
        self.chats: list[dict] = []
        self.loads: list[dict] = []
        self.unloads: list[dict] = []
        self.loaded: set[str] = set()
        self.gate: threading.Event | None = None
        self.received = threading.Event()
        self.legacy = False  # True: an older vLLM without return_token_ids (ids only as "token_id:N" tokens)
        self.fail_chat = False
        self.stream_gate: threading.Event | None = None  # holds a stream after its first token until set
        self.stream_fail = False  # send an error event instead of the second token
        self.stream_held = threading.Event()
        self.stream_ends: list[str] = []  # per stream: "done", or "closed" when the client went away mid-stream
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.chats.append(body)
            self.received.set()
            if self.gate is not None:
                await asyncio.to_thread(self.gate.wait, 30)
            if self.fail_chat:
                return JSONResponse(status_code=500, content={"error": "engine dead"})
            if body["model"] not in self.loaded | {"base"}:
                return JSONResponse(status_code=404, content={"error": f"model {body['model']} not found"})
            if body.get("stream"):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            content = [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                       for t, lp in zip(RESPONSE_IDS, LOGPROBS)]
            choice = {"index": 0, "message": {"role": "assistant", "content": "Five."}, "finish_reason": "stop",
                      "logprobs": {"content": content}}
            out = {"id": "cmpl-fake", "object": "chat.completion", "model": body["model"], "choices": [choice]}
            if not self.legacy:
                choice["token_ids"] = RESPONSE_IDS
                out["prompt_token_ids"] = PROMPT_IDS
            return out

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request):
            body = await request.json()
            if body["lora_name"] in self.loaded:
                return JSONResponse(status_code=400, content={"error": "already loaded"})
            if body["lora_path"].endswith("missing"):
                return JSONResponse(status_code=404, content={"error": "no such path"})
            self.loads.append(body)
            self.loaded.add(body["lora_name"])
            return "Success"

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request):
            body = await request.json()
            self.unloads.append(body)
            self.loaded.discard(body["lora_name"])
            return "Success"

        return app

    async def _stream(self, body):
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}

        def event(choice: dict, **extra) -> str:
            return f"data: {json.dumps({**base, 'choices': [{'index': 0, **choice}], **extra})}\n\n"

        end = "closed"
        try:
            yield event({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
                        prompt_token_ids=PROMPT_IDS)
            for i, (tok, lp, piece) in enumerate(zip(RESPONSE_IDS, LOGPROBS, PIECES)):
                if i == 1 and self.stream_fail:
                    yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 500}})}\n\n"
                    end = "done"
                    return
                if i == 1 and self.stream_gate is not None:
                    self.stream_held.set()
                    while not self.stream_gate.is_set():
                        await asyncio.sleep(0.01)
                last = i == len(RESPONSE_IDS) - 1
                item = {"token": f"token_id:{tok}", "logprob": lp, "bytes": None, "top_logprobs": []}
                yield event({"delta": {"content": piece} if piece else {}, "logprobs": {"content": [item]},
                             "finish_reason": "stop" if last else None, "token_ids": [tok]})
            yield "data: [DONE]\n\n"
            end = "done"
        finally:
            self.stream_ends.append(end)


@pytest.fixture
def fake():
    f = FakeVLLM()
    server = ServiceThread(f.app).start()
    f.url = server.url
    yield f
    if f.gate is not None:
        f.gate.set()
    server.stop()


def _wait_unloaded(fake, *adapters: str) -> None:
    """Wait until vLLM was asked to unload exactly ``adapters`` (in any order): a retired adapter is unloaded on a
    background thread once its last request ends."""
    want = [{"lora_name": name} for name in sorted(adapters)]
    wait_until(lambda: sorted(fake.unloads, key=lambda x: x["lora_name"]) == want,
               lambda: f"vLLM to be asked to unload {list(adapters)} (asked: {fake.unloads})")


def test_forwarding_requests_logprobs_and_records_the_exact_sum(fake):
    buf = big_buffer()
    backend = OpenAIBackend(fake.url + "/v1", "base", default_max_tokens=32)
    with running_service(backend, buf) as (_, url), ClaasServiceClient(url, admin_key=ADMIN) as client:
        resp = client.chat(USER, scenario_id=4, step_idx=1, logprobs=True)
        assert client.feedback(resp["id"], 1.0, "ok")["status"] == "accepted"
    [sent] = fake.chats
    # docs/math.md §0: every sampling field is sent explicitly (vLLM would otherwise fill them from generation_config).
    assert sent["model"] == "base" and sent["messages"] == USER
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"], sent["repetition_penalty"]) == (
        1.0, 1.0, -1, 0.0, 1.0)
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and sent["max_tokens"] == 32
    assert resp["choices"][0]["message"]["content"] == "Five." and resp["claas"]["record"] == "pending_feedback"
    assert [c["logprob"] for c in resp["choices"][0]["logprobs"]["content"]] == LOGPROBS
    [entry] = buf.entries()
    assert entry.prompt_ids.tolist() == PROMPT_IDS and entry.response_ids.tolist() == RESPONSE_IDS
    assert entry.behaviour_logprob == -0.875 and entry.n_tokens == 3  # -0.5 - 0.25 - 0.125, EOS included
    assert (entry.scenario_id, entry.step_idx, entry.P, entry.metadata["model"]) == (4, 1, 0, "base")


def test_legacy_server_ids_from_tokens_and_prompt_from_local_template(fake):
    fake.legacy = True
    tok = ensure_tiny().student
    buf = big_buffer()
    with running_service(OpenAIBackend(fake.url, "base"), buf) as (_, url), ClaasServiceClient(url) as client:
        no_tok = client.chat(USER)
        assert no_tok["claas"]["record"] == "rejected" and "no prompt token ids" in no_tok["claas"]["reason"]
    backend = OpenAIBackend(fake.url, "base", tokenizer=tok)
    with running_service(backend, buf) as (_, url), ClaasServiceClient(url, admin_key=ADMIN) as client:
        resp = client.chat(USER)
        assert client.feedback(resp["id"], 0.0)["status"] == "accepted"
    [entry] = buf.entries()
    from claas_verl.claas.service.templating import render_prompt_ids

    assert entry.prompt_ids.tolist() == render_prompt_ids(backend.tokenizer, USER)
    assert entry.response_ids.tolist() == RESPONSE_IDS and entry.behaviour_logprob == -0.875


def test_hot_reload_switches_adapter_and_unloads_the_old_one(fake, tmp_path):
    buf = big_buffer()
    backend = OpenAIBackend(fake.url, "base", lora_prefix="claas")
    with running_service(backend, buf) as (_, url), ClaasServiceClient(url, admin_key=ADMIN) as client:
        r0 = client.chat(USER)
        buf.on_update()  # the trainer's step k=1, then it publishes version 1
        # no adapter file this process can read (the fake server's path): no digest to name
        assert client.load_adapter(str(tmp_path / "step1")) == {"tenant": "default", "policy_version": 1,
                                                                "adapter_sha256": None, "model": "claas-v1"}
        assert fake.loads == [{"lora_name": "claas-v1", "lora_path": str(tmp_path / "step1")}]
        r1 = client.chat(USER)
        buf.on_update()
        import torch
        from safetensors.torch import save_file

        from claas_verl.claas.tenants.adapters import adapter_digest

        (tmp_path / "step2").mkdir()  # an adapter file readable here: the reply names its digest
        weights = {"base_model.model.lora_A.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
        save_file(weights, str(tmp_path / "step2" / "adapter_model.safetensors"))
        assert client.load_adapter(str(tmp_path / "step2"))["model"] == "claas-v2"
        _wait_unloaded(fake, "claas-v1")  # base is never unloaded
        r2 = client.chat(USER)
        assert r2["claas"]["adapter_sha256"] == adapter_digest(weights) and r1["claas"]["adapter_sha256"] is None
        for r in (r0, r1, r2):
            client.feedback(r["id"], 1.0)
        assert sorted(m["id"] for m in client.models()["data"]) == ["base", "claas-v2"]
        # A server that cannot load: 502 with the hint, and nothing changes.
        bad = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": str(tmp_path / "missing")},
                            headers={"Authorization": f"Bearer {ADMIN}"})
        assert bad.status_code == 502 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in bad.json()["error"]["message"]
        assert client.health()["policy_version"] == 2
    assert [c["model"] for c in fake.chats] == ["base", "claas-v1", "claas-v2"]
    assert [(r["model"], r["claas"]["policy_version"]) for r in (r0, r1, r2)] == [
        ("base", 0), ("claas-v1", 1), ("claas-v2", 2)]
    assert sorted(e.P for e in buf.entries()) == [0, 1, 2]


def test_in_flight_request_keeps_its_version_and_delays_the_unload(fake, tmp_path):
    buf = big_buffer()
    backend = OpenAIBackend(fake.url, "base")
    with running_service(backend, buf) as (service, url), ClaasServiceClient(url, admin_key=ADMIN) as client:
        buf.on_update()
        client.load_adapter(str(tmp_path / "v1"))
        fake.gate = threading.Event()  # hold the next reply inside the "engine"
        fake.received.clear()
        result = {}
        def run_chat():
            with ClaasServiceClient(url) as own:  # its own connection pool: httpx clients are not shared
                result.update(own.chat(USER))

        t = threading.Thread(target=run_chat)
        t.start()
        assert fake.received.wait(20)  # the request is running on claas-v1
        buf.on_update()
        client.load_adapter(str(tmp_path / "v2"))  # reload while it runs
        assert client.health()["policy_version"] == 2
        time.sleep(0.2)
        assert fake.unloads == []  # claas-v1 still serves the running request
        fake.gate.set()
        t.join(20)
        _wait_unloaded(fake, "claas-v1")
        assert result["model"] == "claas-v1" and result["claas"]["policy_version"] == 1
        assert client.feedback(result["id"], 1.0)["status"] == "accepted"
        after = client.chat(USER)
        assert after["claas"]["policy_version"] == 2 and fake.chats[-1]["model"] == "claas-v2"
    [entry] = buf.entries()
    assert entry.P == 1  # recorded with the version it started with, not the one served when it finished


def test_backend_failure_is_a_502_and_sampling_fields_are_forwarded(fake):
    buf = big_buffer()
    with running_service(OpenAIBackend(fake.url, "base"), buf) as (_, url):
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"messages": USER, "temperature": 0.6, "top_k": 20, "stop": ["\n"], "seed": 3})
        assert r.status_code == 200 and r.json()["claas"]["record"] == "rejected"
        assert (fake.chats[-1]["temperature"], fake.chats[-1]["top_k"], fake.chats[-1]["stop"],
                fake.chats[-1]["seed"]) == (0.6, 20, ["\n"], 3)
        fake.fail_chat = True
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 502 and "HTTP 500" in r.json()["error"]["message"]
    assert len(buf) == 0
    dead = OpenAIBackend("http://127.0.0.1:9", "base", timeout_s=2)  # port 9 (discard): nothing listens
    with running_service(dead, buf) as (_, url):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]


def test_concurrent_reloads_are_serialised(fake, tmp_path):
    backend = OpenAIBackend(fake.url, "base")
    with running_service(backend, big_buffer()) as (service, url):
        def reload(i):
            with ClaasServiceClient(url, admin_key=ADMIN) as c:
                out.append(c.load_adapter(str(tmp_path / f"a{i}"))["policy_version"])

        out: list[int] = []
        threads = [threading.Thread(target=reload, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(out) == [1, 2, 3]  # each reload got its own version; no name collision in vLLM
        assert sorted(x["lora_name"] for x in fake.loads) == ["claas-v1", "claas-v2", "claas-v3"]
        _wait_unloaded(fake, "claas-v1", "claas-v2")
        # From a thread with no event loop (a trainer's update thread), the synchronous form.
        assert service.load_adapter_sync(str(tmp_path / "a4")) == {"tenant": "default", "policy_version": 4,
                                                                   "adapter_sha256": None, "model": "claas-v4"}
        assert httpx.get(f"{url}/health").json()["policy_version"] == 4


def _release_after(event: threading.Event, seconds: float = 20.0) -> dict:
    """Set ``event`` after ``seconds`` unless set before; returns a dict telling whether the timer had to do it."""
    state = {"by_timer": False}

    def run():
        if not event.wait(seconds):
            state["by_timer"] = True
            event.set()

    threading.Thread(target=run, daemon=True).start()
    return state


def test_streaming_forwards_tokens_as_vllm_sends_them_and_records_the_same_entry(fake, tmp_path):
    buf = big_buffer()
    backend = OpenAIBackend(fake.url, "base")
    fake.stream_gate = threading.Event()
    watchdog = _release_after(fake.stream_gate)
    with running_service(backend, buf) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        buf.on_update()
        with ClaasServiceClient(url, admin_key=ADMIN) as admin:
            admin.load_adapter(str(tmp_path / "v1"))
        chunks = []
        for chunk in client.chat.completions.create(model="claas", messages=USER, stream=True, logprobs=True):
            chunks.append(chunk)
            if chunk.choices[0].delta.content == "Fi":
                # vLLM holds the rest; meanwhile an update switches new requests to v2
                assert fake.stream_held.wait(20) and backend.inflight("claas-v1") == 1
                buf.on_update()
                with ClaasServiceClient(url, admin_key=ADMIN) as admin:
                    assert admin.load_adapter(str(tmp_path / "v2"))["policy_version"] == 2
                time.sleep(0.1)
                assert fake.unloads == []  # claas-v1 still serves this stream
                fake.stream_gate.set()
        assert not watchdog["by_timer"], "the first token did not reach the client before vLLM finished"
        _wait_unloaded(fake, "claas-v1")
        plain = client.chat.completions.create(model="claas", messages=USER)
        for rid in (chunks[0].id, plain.id):
            assert httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": 1}).json()["status"] \
                == "accepted"
    streamed_body, plain_body = fake.chats[0], fake.chats[1]
    assert streamed_body["stream"] is True and plain_body["stream"] is False
    assert {k: v for k, v in streamed_body.items() if k not in ("stream", "model")} == \
        {k: v for k, v in plain_body.items() if k not in ("stream", "model")}
    assert [c.choices[0].delta.content for c in chunks] == ["", "Fi", "ve.", "", None]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, None, "stop"]
    assert [c.model_extra["claas"]["policy_version"] for c in chunks] == [1] * 5 and chunks[-1].model == "claas-v1"
    assert [i.logprob for c in chunks if c.choices[0].logprobs for i in c.choices[0].logprobs.content] == LOGPROBS
    assert plain.model_extra["claas"]["policy_version"] == 2
    s, p = sorted(buf.entries(), key=lambda e: e.P)
    assert (s.P, p.P) == (1, 2)  # the stream keeps the version it started on
    for e in (s, p):
        assert e.prompt_ids.tolist() == PROMPT_IDS and e.response_ids.tolist() == RESPONSE_IDS
        assert e.behaviour_logprob == -0.875 and e.metadata["finish_reason"] == "stop"


def test_stream_disconnect_closes_the_upstream_request_and_errors_are_events(fake):
    buf = big_buffer()
    backend = OpenAIBackend(fake.url, "base")
    fake.stream_gate = threading.Event()
    with running_service(backend, buf) as (service, url):
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as resp:
                lines = resp.iter_lines()
                while '"Fi"' not in next(lines):
                    pass
                assert fake.stream_held.wait(20) and backend.inflight("base") == 1
            # the client left: the service closes its request to vLLM (which aborts it) and counts the turn
            wait_until(lambda: fake.stream_ends == ["closed"] and backend.inflight("base") == 0,
                       lambda: f"the upstream stream to close ({fake.stream_ends}, {backend.inflight('base')} open)")
            fake.stream_gate.set()
            fake.stream_fail = True
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIError, match="engine died"):
                list(client.chat.completions.create(model="claas", messages=USER, stream=True))
            stats = http.get("/v1/claas/stats").json()
    assert stats["turns"]["dropped"]["disconnected"] == 1 and stats["turns"]["dropped"]["stream_error"] == 1
    assert (stats["turns"]["served"], stats["turns"]["recorded"], stats["turns"]["pending"]) == (0, 0, 0)
    assert len(buf) == 0 and backend.inflight("base") == 0
