"""Token streaming of the chat API with the real ``openai`` client over real HTTP (tiny model on CPU, HFBackend).

What is checked: content chunks reach the client while the model is still generating (a forward hook holds the
model mid-response, and chunks must already have arrived), the chunk format (role delta, content deltas, a final chunk
with finish_reason + usage, [DONE]), the ``claas`` object on every chunk, that the recorded entry equals a non-streamed
turn's with the same sampled tokens, and that a client that disconnects mid-stream stops the generation and leaves no
pending turn (counted as ``disconnected``).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading

import httpx
import pytest
import torch
from openai import OpenAI
from service_helpers import USER, big_buffer, running_service, wait_until

from claas_verl.claas.service import ChatService, HFBackend, IncrementalDetokenizer, ServiceConfig
from claas_verl.claas.service.backend import ChatBackend, Generation
from claas_verl.tiny import ensure_tiny

torch.set_num_threads(1)
WATCHDOG_S = 30.0


@pytest.fixture(scope="module")
def backend():
    b = HFBackend(ensure_tiny().student, default_max_tokens=8, seed=0)
    b.eos_token_ids = set()  # never stop early: every reply has exactly max_tokens tokens
    return b


class Gate:
    """A forward pre-hook that holds the model at its ``at``-th forward call (the prompt is call 1, so ``at - 1``
    tokens exist then) until :meth:`open`; a watchdog opens it after WATCHDOG_S so a broken stream fails, not hangs."""

    def __init__(self, model, at: int):
        self.at, self.calls = at, 0
        self.held = threading.Event()
        self._open = threading.Event()
        self.by_watchdog = False
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1
        if self.calls == self.at:
            self.held.set()
            if not self._open.wait(WATCHDOG_S):
                self.by_watchdog = True

    def open(self):
        self._open.set()

    def remove(self):
        self._open.set()
        self._handle.remove()


def _token_chunks(chunks) -> list:
    return [c for c in chunks if c.choices and c.choices[0].logprobs is not None and c.choices[0].logprobs.content]


def test_tokens_reach_the_client_while_the_model_generates(backend):
    buf = big_buffer()
    n_tokens, hold_at = 12, 6  # held before token 6: tokens 1..5 are sampled and must already be at the client
    gate = Gate(backend.model, hold_at)
    try:
        with running_service(backend, buf) as (service, url):
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            stream = client.chat.completions.create(model="claas", messages=USER, max_tokens=n_tokens, seed=11,
                                                    logprobs=True, stream=True)
            chunks, seen_while_held = [], None
            for chunk in stream:
                chunks.append(chunk)
                if len(_token_chunks(chunks)) == hold_at - 1:
                    # The model is stopped before its 6th token; the 5 sampled ones are here already.
                    assert gate.held.wait(WATCHDOG_S)
                    seen_while_held = (len(_token_chunks(chunks)), gate.calls)
                    gate.open()
            assert not gate.by_watchdog, "no chunk reached the client before the generation ended"
            assert seen_while_held == (hold_at - 1, hold_at)
            plain = client.chat.completions.create(model="claas", messages=USER, max_tokens=n_tokens, seed=11)
            head, final = chunks[0], chunks[-1]
            rid = head.id
            for r in (rid, plain.id):
                assert asyncio.run(service.feedback({"request_id": r, "reward": 1}))["status"] == "accepted"
    finally:
        gate.remove()
    # OpenAI's chunk format: role delta first, then content deltas, the last chunk with finish_reason and usage.
    assert head.choices[0].delta.role == "assistant" and head.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == rid for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert final.usage.completion_tokens == n_tokens and len(_token_chunks(chunks)) == n_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content
    # The claas object: request id and serving version on every chunk, the full object on the last one.
    heads = [c.model_extra["claas"] for c in chunks[:-1]]
    assert all(h == {"request_id": rid, "tenant": "default", "policy_version": 0, "adapter_sha256": None,
                    "scenario_id": None, "step_idx": None} for h in heads)
    full = final.model_extra["claas"]
    assert (full["request_id"], full["policy_version"], full["record"], full["n_tokens"]) == (
        rid, 0, "pending_feedback", n_tokens)
    streamed_lps = [c.choices[0].logprobs.content[0].logprob for c in _token_chunks(chunks)]
    assert full["behaviour_logprob"] == min(math.fsum(streamed_lps), 0.0)
    # The recorded entry equals the non-streamed turn's with the same sampled tokens (same seed, same weights).
    entries = {e.uid: e for e in buf.entries()}
    s, p = entries[rid], entries[plain.id]
    assert s.prompt_ids.tolist() == p.prompt_ids.tolist()
    assert s.response_ids.tolist() == p.response_ids.tolist()
    assert [int(c.choices[0].logprobs.content[0].token.removeprefix("token_id:")) for c in _token_chunks(chunks)] \
        == s.response_ids.tolist()
    assert (s.behaviour_logprob, s.P, s.scenario_id, s.n_tokens) == (p.behaviour_logprob, p.P, p.scenario_id,
                                                                     n_tokens)


def test_disconnect_mid_stream_stops_the_generation_and_leaves_nothing_pending(backend):
    buf = big_buffer()
    gate = Gate(backend.model, 4)
    stopped_before = backend.stopped_early
    try:
        with running_service(backend, buf) as (service, url):
            with httpx.Client(base_url=url, timeout=60) as http:
                body = {"messages": USER, "max_tokens": 200, "stream": True}
                with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                    lines = resp.iter_lines()
                    first = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
                    assert first["claas"]["policy_version"] == 0
                    assert gate.held.wait(WATCHDOG_S)
                # the client has gone away while the generation is held inside the model: the service notices
                wait_until(lambda: service.stats()["dropped_disconnected"] > 0,
                           "the service to notice the disconnect", WATCHDOG_S)
                gate.open()
                wait_until(lambda: backend.stopped_early != stopped_before,
                           "the generation to stop after the disconnect", WATCHDOG_S)
                assert gate.calls <= 5  # stopped right after the held forward (4), not after 200 tokens
                after = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
                assert after["claas"]["record"] == "pending_feedback"  # the model (and its lock) serves again
                stats = http.get("/v1/claas/stats").json()
    finally:
        gate.remove()
    assert stats["turns"]["dropped"]["disconnected"] == 1
    assert (stats["turns"]["served"], stats["turns"]["recorded"], stats["turns"]["pending"]) == (1, 1, 1)


class Scripted(ChatBackend):
    """Whole responses only (the default stream): three tokens, log-probs -1, -2, -3."""

    served_model = "scripted"
    policy_version = 4

    async def generate(self, messages, params, chat_template_kwargs=None):
        return Generation(prompt_ids=[1, 2, 3], response_ids=[7, 8, 2], token_logprobs=[-1.0, -2.0, -3.0],
                          text="ok!", finish_reason="stop", policy_version=4, model="scripted")

    async def load_adapter(self, path, version=None):
        raise ValueError("no adapters")


def test_a_backend_without_token_streaming_still_streams_one_delta():
    assert Scripted.streams_tokens is False and HFBackend.streams_tokens is True
    buf = big_buffer()
    with running_service(Scripted(), buf) as (_, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(model="claas", messages=USER, stream=True))
    assert [c.choices[0].delta.content for c in chunks] == ["", "ok!", None]
    assert chunks[-1].model_extra["claas"]["behaviour_logprob"] == -6.0
    assert [c.model_extra["claas"]["policy_version"] for c in chunks] == [4, 4, 4]


def test_final_chunk_lost_withdraws_the_pending_turn():
    """A client gone while the final chunk was being sent (the response is closed at that chunk): the turn that was
    just put in the pending table is withdrawn and counted once, never left to expire."""
    service = ChatService(Scripted(), big_buffer(), config=ServiceConfig(allow_keyless=True))

    async def run():
        events = await service.chat_stream({"messages": USER, "stream": True})
        seen = [await anext(events) for _ in range(3)]  # role, content, final (the turn is pending now)
        assert json.loads(seen[2][5:])["claas"]["record"] == "pending_feedback"
        assert service.recorder.stats()["pending_now"] == 1
        await events.aclose()

    asyncio.run(run())
    stats = service.stats()
    assert stats["turns"]["pending"] == 0 and stats["turns"]["dropped"]["disconnected"] == 1
    assert service.recorder.stats()["dropped_disconnected"] == 1 and stats["turns"]["completed"] == 0


def test_incremental_detokenizer_never_sends_a_cut_character():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny().student))
    text = "héllo wörld — 世界 🙂🙃 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([t]) for t in ids]
    rest, full = detok.finish()
    assert full == tok.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) + rest == text and not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some token ended inside a multi-byte character: its text was held back
