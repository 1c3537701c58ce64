"""The chat API as agents use it: the real ``openai`` client over real HTTP, auth, limits, reward validation,
streaming, and the job's rollout backend (scripted servers, no model: these run in a few seconds)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from types import SimpleNamespace

import httpx
import pytest
import service_helpers
from openai import APIStatusError, AuthenticationError, OpenAI
from service_helpers import ADMIN, USER, big_buffer, running_service

from claas_verl.claas.service.app import validate_reward
from claas_verl.claas.service.rollout_backend import RolloutBackend
from claas_verl.tiny import ensure_tiny

KEY = "sk-test-key"


class Scripted(service_helpers.Scripted):
    """The helpers' scripted backend; ``finish`` is what the server reported, and it loads no adapter."""

    def __init__(self, finish: str = "stop"):
        super().__init__()
        self.finish = finish

    async def generate(self, messages, params, chat_template_kwargs=None):
        gen = await super().generate(messages, params, chat_template_kwargs)
        return dataclasses.replace(gen, finish_reason=self.finish)

    async def load_adapter(self, path, version=None):
        raise ValueError("no adapters")


def test_openai_client_plain_and_streamed_with_claas_fields():
    buf = big_buffer()
    backend = Scripted()
    with running_service(backend, buf, api_keys=(KEY,)) as (service, url):
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.create(model="claas", messages=USER, max_tokens=4)
        claas = r.model_extra["claas"]
        assert r.choices[0].message.content == "ok!" and r.choices[0].finish_reason == "stop"
        assert (claas["request_id"], claas["policy_version"], claas["record"]) == (r.id, 0, "pending_feedback")
        assert claas["behaviour_logprob"] == -6.0
        for _ in range(3):
            buf.on_update()  # the trainer's k follows the served version (a P above k would be clamped)
        backend.version = 3
        chunks = list(client.chat.completions.create(model="claas", messages=USER, max_tokens=4, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "ok!" and chunks[-1].choices[0].finish_reason == "stop"
        sclaas = chunks[-1].model_extra["claas"]  # the full claas object rides on the final chunk
        assert all(c.model_extra["claas"]["request_id"] == sclaas["request_id"] == c.id for c in chunks)
        assert all(c.model_extra["claas"]["policy_version"] == 3 for c in chunks)
        assert sclaas["record"] == "pending_feedback" and "record" not in chunks[0].model_extra["claas"]
        headers = {"Authorization": f"Bearer {KEY}"}
        for rid, reward in ((r.id, 1), (sclaas["request_id"], 0)):
            out = httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": reward}, headers=headers)
            assert out.json()["status"] == "accepted"
        mine = httpx.get(f"{url}/v1/claas/stats", headers=headers).json()  # a user key sees its own counts
        assert mine["key_id"].startswith("key-") and mine["accepted"] == 2 and "turns" not in mine
        stats = httpx.get(f"{url}/v1/claas/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    # The streamed turn is recorded exactly like the plain one.
    entries = sorted(buf.entries(), key=lambda e: e.P)
    assert [(e.uid, e.P, e.reward, e.behaviour_logprob) for e in entries] == [
        (r.id, 0, 1.0, -6.0), (sclaas["request_id"], 3, 0.0, -6.0)]
    assert stats["turns"] | {"dropped": None} == {"served": 2, "recorded": 2, "pending": 0, "completed": 2,
                                                  "accepted": 2, "expired": 0, "dropped": None}


def test_api_keys_guard_every_endpoint_but_health():
    with running_service(Scripted(), big_buffer(), api_keys=(KEY, "second")) as (_, url):
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="claas", messages=USER)
        for method, path in (("post", "/v1/chat/completions"), ("post", "/v1/feedback"), ("get", "/v1/claas/stats"),
                             ("get", "/v1/models"), ("post", "/v1/claas/load_adapter")):
            assert httpx.request(method, f"{url}{path}", json={}).status_code == 401, path
        assert httpx.get(f"{url}/health").json()["policy_version"] == 0
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer second"})
        assert ok.status_code == 200
        # An API key is not the admin key: adapter loads and shutdown need the admin key.
        r = httpx.post(f"{url}/v1/claas/shutdown", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 401


def test_adapter_loads_only_from_the_adapter_root(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    with running_service(Scripted(), big_buffer(), admin_key="adm", adapter_root=str(root)) as (_, url):
        admin = {"Authorization": "Bearer adm"}
        for path in ("/etc", str(root / ".." / "elsewhere")):
            r = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": path}, headers=admin)
            assert r.status_code == 403 and "output directory" in r.json()["error"]["message"]
        (tmp_path / "outside").mkdir()
        (root / "link").symlink_to(tmp_path / "outside")  # a symlink out of the root is resolved and refused
        r = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": str(root / "link")}, headers=admin)
        assert r.status_code == 403
        r = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": str(root / "a")}, headers=admin)
        assert r.status_code == 400 and "no adapters" in r.json()["error"]["message"]  # reached the backend


@pytest.mark.parametrize("reward, mode, ok", [
    (0, "binary", True), (1.0, "binary", True), (0.5, "binary", False), (1e300, "binary", False),
    (-5, "binary", False), (float("nan"), "binary", False), (True, "binary", False), ("1", "binary", False),
    (0.25, "unit", True), (1e300, "unit", False), (-5, "unit", False), (float("inf"), "unit", False),
    (None, "binary", True),
])
def test_reward_validation(reward, mode, ok):
    if ok:
        assert validate_reward(reward, mode) == (None if reward is None else float(reward))
    else:
        with pytest.raises(ValueError, match="'reward'"):
            validate_reward(reward, mode)


def test_bad_rewards_and_limits_over_http():
    buf = big_buffer()
    with running_service(Scripted(), buf, max_body_bytes=4096, max_messages=3, max_message_chars=100,
                         max_tokens=16, max_pending=2) as (service, url):
        rid = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}).json()["id"]
        for reward in (1e300, -5, 0.5):
            r = httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": reward})
            assert r.status_code == 400 and "'reward'" in r.json()["error"]["message"], reward
        # NaN is not JSON; sent as the non-standard literal it is refused as well
        r = httpx.post(f"{url}/v1/feedback", content=b'{"request_id": "%s", "reward": NaN}' % rid.encode(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "'reward'" in r.json()["error"]["message"]
        assert service.recorder.is_pending(rid)  # nothing accepted was lost by the bad feedback
        for body, status, needle in [
            ({"messages": USER, "padding": "x" * 5000}, 413, "4096"),
            ({"messages": USER * 2}, 400, "at most 3"),
            ({"messages": [{"role": "user", "content": "y" * 101}]}, 400, "messages[0].content"),
            ({"messages": USER, "max_tokens": 17}, 400, "'max_tokens'=17"),
        ]:
            r = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == status and needle in r.json()["error"]["message"], (body.keys(), r.text)
        # Pending turns are bounded: two more turns push the first one out (counted as overflow).
        for _ in range(2):
            httpx.post(f"{url}/v1/chat/completions", json={"messages": USER})
        stats = httpx.get(f"{url}/v1/claas/stats").json()
    assert stats["turns"]["pending"] == 2 and stats["turns"]["dropped"]["overflow"] == 1
    assert len(buf) == 0


def test_aborted_generations_are_served_but_never_recorded():
    buf = big_buffer()
    with running_service(Scripted(finish="abort"), buf) as (_, url):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}).json()
        stats = httpx.get(f"{url}/v1/claas/stats").json()
    assert r["claas"]["record"] == "dropped" and "abort" in r["claas"]["reason"]
    assert stats["turns"]["dropped"]["aborted"] == 1 and stats["turns"]["recorded"] == 0 and len(buf) == 0


def test_rollout_backend_uses_the_servers_tokens_and_version():
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(ensure_tiny().student))
    calls = []

    async def generate(request_id, prompt_ids, sampling):
        calls.append((prompt_ids, sampling))
        ids = [5, 6, tok.eos_token_id] if sampling["max_tokens"] > 2 else [5, 6]
        stop = "aborted" if sampling.get("seed") == 99 else "completed"
        return SimpleNamespace(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason=stop,
                               extra_fields={"global_steps": 7})

    backend = RolloutBackend(generate, tok, default_max_tokens=4, max_model_len=512, policy_version=6)
    from claas_verl.claas.service.sampling import SamplingParams
    from claas_verl.claas.service.templating import render_prompt_ids

    gen = asyncio.run(backend.generate(USER, SamplingParams()))
    assert gen.prompt_ids == render_prompt_ids(tok, USER) == calls[0][0]
    assert (gen.response_ids, gen.finish_reason, gen.policy_version) == ([5, 6, tok.eos_token_id], "stop", 7)
    assert calls[0][1] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                           "logprobs": True, "max_tokens": 4}
    assert asyncio.run(backend.generate(USER, SamplingParams(max_tokens=2))).finish_reason == "length"
    assert asyncio.run(backend.generate(USER, SamplingParams(seed=99))).finish_reason == "abort"
    with pytest.raises(ValueError, match="repetition_penalty"):
        asyncio.run(backend.generate(USER, SamplingParams(repetition_penalty=1.1)))
    backend.publish(8)
    with pytest.raises(ValueError, match="never go back"):
        backend.publish(7)
    assert backend.policy_version == 8 and math.isfinite(sum(gen.token_logprobs))
    with pytest.raises(ValueError, match="trainer pushes"):
        asyncio.run(backend.load_adapter("/x"))


def test_openai_status_error_carries_the_field_name():
    with running_service(Scripted(), big_buffer(), max_tokens=8) as (_, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(APIStatusError) as err:
            client.chat.completions.create(model="claas", messages=USER, max_tokens=9)
    assert err.value.status_code == 400 and "max_tokens" in str(err.value)
