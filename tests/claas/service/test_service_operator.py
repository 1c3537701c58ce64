"""What an operator runs the chat service with: Prometheus metrics, the audit log, a TLS-terminating reverse proxy's
forwarded headers, graceful shutdown (also on SIGTERM), template rendering off the event loop, and the versions
and completeness of responses from the training job's rollout servers and from vLLM. Real HTTP on 127.0.0.1."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from service_helpers import ADMIN, USER, Scripted, big_buffer, running_service, wait_until

from claas_verl.claas.service import ChatService, ServiceConfig, build_app
from claas_verl.claas.service.server import ServiceThread

KEY = "sk-operator"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from claas_verl.tiny import ensure_tiny

    return AutoTokenizer.from_pretrained(str(ensure_tiny().student))


def test_prometheus_metrics_need_the_admin_key_and_count_by_outcome_and_key():
    buf = big_buffer()
    with running_service(Scripted(), buf, api_keys=(KEY,)) as (service, url):
        auth = {"Authorization": f"Bearer {KEY}"}
        rid = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}, headers=auth).json()["id"]
        httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": 1}, headers=auth)
        httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": 1}, headers=auth)  # unknown now
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers=auth).status_code == 401  # a user key is not enough
        r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    kid = service.recorder.key_stats().popitem()[0]
    for line in ('claas_turns_total{outcome="served"} 1.0', 'claas_turns_total{outcome="accepted"} 1.0',
                 'claas_turns_total{outcome="feedback_unknown"} 1.0', 'claas_turns_dropped_total{reason="timeout"} 0.0',
                 f'claas_key_turns_total{{key_id="{kid}",outcome="accepted"}} 1.0', "claas_buffer_entries 1.0",
                 "claas_buffer_capacity 1000.0", "claas_policy_version 0.0", "claas_pending_turns 0.0",
                 'claas_request_seconds_count{endpoint="chat"} 1.0',
                 'claas_request_seconds_count{endpoint="feedback"} 2.0'):
        assert line in text, line
    assert KEY not in text


def test_audit_log_names_key_ids_and_the_real_client_behind_a_proxy(caplog):
    """Behind a TLS-terminating reverse proxy (trusted at 127.0.0.1), X-Forwarded-For/-Proto give the audit log the
    real client; a service that trusts no proxy ignores the same headers (a client cannot forge its address)."""
    caplog.set_level(logging.INFO, logger="claas_verl.claas.service.audit")
    forwarded = {"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Proto": "https", "Authorization": f"Bearer {KEY}"}
    lines, ids = {}, {}
    for trusted in (True, False):
        service = ChatService(Scripted(), big_buffer(), config=ServiceConfig(api_keys=(KEY,)))
        kwargs = {"proxy_headers": True, "forwarded_allow_ips": "127.0.0.1"} if trusted else {}
        with ServiceThread(build_app(service), **kwargs) as server:
            caplog.clear()
            r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER}, headers=forwarded)
            assert r.status_code == 200
            ids[trusted] = r.json()["id"]
            httpx.post(f"{server.url}/v1/feedback", json={"request_id": r.json()["id"], "reward": 1},
                       headers={"Authorization": "Bearer wrong"})
        lines[trusted] = [rec.getMessage() for rec in caplog.records if rec.name == "claas_verl.claas.service.audit"]
    import json

    chat, denied = (json.loads(x) for x in lines[True][:2])
    assert chat["client"] == "203.0.113.7" and chat["key_id"].startswith("key-") and chat["status"] == 200
    assert chat["request_id"] == ids[True] and chat["path"] == "/v1/chat/completions"
    assert denied["status"] == 401 and denied["key_id"] == "-"
    assert json.loads(lines[False][0])["client"] == "127.0.0.1"
    assert all(KEY not in line and "wrong" not in line.split('"error"')[0] for line in lines[True] + lines[False])


def test_graceful_stop_finishes_requests_in_flight_and_counts_what_is_left():
    backend = Scripted(delay_s=1.5)
    service = ChatService(backend, big_buffer(), config=ServiceConfig(allow_keyless=True))
    server = ServiceThread(build_app(service)).start()
    out = {}
    inflight = threading.Thread(target=lambda: out.update(r=httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": USER}, timeout=30)))
    inflight.start()
    # the generation has started: the request is in flight, not still connecting
    wait_until(lambda: backend.seen_kwargs, "the chat to reach the backend")
    server.stop()
    inflight.join(30)
    assert out["r"].status_code == 200 and out["r"].json()["claas"]["record"] == "pending_feedback"
    stats = service.recorder.stats()
    # the served turn can get no feedback any more: counted, never silently lost
    assert (stats["served"], stats["pending_now"], stats["dropped_shutdown"]) == (1, 0, 1)
    assert not service.accepting and not server.alive


def test_sigterm_drains_a_standalone_service(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        from service_helpers import Scripted, big_buffer
        from claas_verl.claas.service import ChatService, ServiceConfig, build_app
        from claas_verl.claas.service.server import ServiceThread
        class Announcing(Scripted):  # tells the test when a generation is in flight
            async def generate(self, *args, **kwargs):
                print("generating", flush=True)
                return await super().generate(*args, **kwargs)
        service = ChatService(Announcing(delay_s=1.0), big_buffer(), config=ServiceConfig(allow_keyless=True))
        server = ServiceThread(build_app(service)).start()
        stopped = server.stop_on_signals()
        print(server.url, flush=True)
        stopped.wait()
        print(json.dumps(service.recorder.stats()["served"]), flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, str(script), str(Path(__file__).parent)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        out = {}
        chat = threading.Thread(target=lambda: out.update(r=httpx.post(
            f"{url}/v1/chat/completions", json={"messages": USER}, timeout=30)))
        chat.start()
        assert proc.stdout.readline().strip() == "generating"
        proc.send_signal(signal.SIGTERM)
        chat.join(30)
        assert proc.wait(30) == 0
        assert out["r"].status_code == 200 and proc.stdout.read().strip() == "1"
    finally:
        proc.kill()


def test_template_rendering_runs_off_the_event_loop_and_is_bounded(tokenizer):
    """An allowed template argument that makes the template expand (2M characters, ~2 s of Jinja) neither stalls
    the API (/health answers meanwhile) nor becomes a prompt: 400 naming chat_template_kwargs."""
    from claas_verl.claas.service.rollout_backend import RolloutBackend

    async def generate(request_id, prompt_ids, sampling):
        return SimpleNamespace(token_ids=[5, 6], log_probs=[-1.0, -1.0], stop_reason="length", extra_fields={})

    saved = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}"
                               "{% for i in range(100000) %}{% for j in range(20) %}x{% endfor %}{% endfor %}"
                               "{% endif %}")
    try:
        health_s, out = _render_while_probing(RolloutBackend(generate, tokenizer))
    finally:
        tokenizer.chat_template = saved
    assert health_s < 0.5, health_s
    assert out["r"].status_code == 400 and "chat_template_kwargs" in out["r"].json()["error"]["message"]


def _render_while_probing(backend) -> tuple[float, dict]:
    """Seconds /health took while a chat asking for the expansion was rendered, and that chat's response."""
    with running_service(backend, big_buffer()) as (_, url):
        out = {}
        slow = threading.Thread(target=lambda: out.update(r=httpx.post(
            f"{url}/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": True}},
            timeout=60)))
        slow.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        health_s = time.monotonic() - t0
        slow.join(60)
    return health_s, out


def test_a_response_spanning_two_policy_versions_is_never_recorded(tokenizer):
    from claas_verl.claas.service.rollout_backend import RolloutBackend

    spans = iter([(3, 4), (3, 3)])

    async def generate(request_id, prompt_ids, sampling):
        first, last = next(spans)
        return SimpleNamespace(token_ids=[5, 6], log_probs=[-1.0, -1.0], stop_reason="length",
                               extra_fields={"global_steps": last, "min_global_steps": first, "max_global_steps": last})

    with running_service(RolloutBackend(generate, tokenizer, policy_version=3), big_buffer()) as (service, url):
        mixed = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}).json()
        whole = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}).json()
        stats = service.recorder.stats()
    assert mixed["claas"]["record"] == "dropped" and "more than one policy version" in mixed["claas"]["reason"]
    assert mixed["choices"][0]["finish_reason"] == "mixed_version"
    assert whole["claas"]["record"] == "pending_feedback" and whole["claas"]["policy_version"] == 3
    assert stats["dropped_mixed_version"] == 1


def test_a_vllm_reply_without_finish_reason_is_not_complete():
    from claas_verl.claas.service.openai_backend import OpenAIBackend

    backend = OpenAIBackend("http://127.0.0.1:9", "tiny")
    data = {"choices": [{"message": {"content": "ok"}, "finish_reason": None, "token_ids": [5, 6],
                         "logprobs": {"content": [{"token": "token_id:5", "logprob": -1.0},
                                                  {"token": "token_id:6", "logprob": -1.0}]}}],
            "prompt_token_ids": [1, 2]}
    gen = backend._parse(data, "tiny", 0, USER, None)
    assert gen.finish_reason not in ("stop", "length")  # the service drops such a turn (counted dropped_aborted)
