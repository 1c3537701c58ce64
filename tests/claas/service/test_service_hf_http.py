"""The chat service over real HTTP (uvicorn on 127.0.0.1) with the tiny model on CPU (HFBackend)."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from service_helpers import USER, big_buffer, recompute_logprob, running_service, wait_until
from transformers import AutoModelForCausalLM

from claas_verl.claas.envs import Grade, GraderError, Verdict
from claas_verl.claas.service import ClaasServiceClient, HFBackend, verifier_grader
from claas_verl.claas.service.templating import render_prompt_ids
from claas_verl.tiny import ensure_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny()


@pytest.fixture(scope="module")
def backend(tiny):
    return HFBackend(tiny.student, default_max_tokens=8, seed=0)


@pytest.fixture(scope="module")
def reference_model(tiny):
    # An independent copy from disk: the recomputation must not share state with the served model.
    return AutoModelForCausalLM.from_pretrained(str(tiny.student), dtype=torch.float32).eval()


def test_chat_round_trip_records_exact_behaviour_logprob(backend, reference_model):
    buf = big_buffer()
    with running_service(backend, buf, grader=lambda req: Grade(reward=1.0, feedback=None), grade_inline=True) as (
        _, url,
    ), ClaasServiceClient(url) as client:
        assert client.health()["status"] == "ok"
        assert [m["id"] for m in client.models()["data"]] == ["claas-hf"]
        resp = client.chat(USER, step_idx=2, headers={"X-Claas-Scenario-Id": "7"}, max_tokens=6, seed=3)
    claas = resp["claas"]
    assert claas["record"] == "accepted" and claas["reason"] is None and claas["policy_version"] == 0
    assert resp["choices"][0]["message"]["role"] == "assistant"
    [entry] = buf.entries()
    assert entry.uid == resp["id"] == claas["request_id"]
    assert (entry.scenario_id, entry.step_idx, entry.P, entry.reward) == (7, 2, 0, 1.0)
    # prompt ids = the whole chat context as templated by the tokenizer (generation prompt included).
    assert entry.prompt_ids.tolist() == render_prompt_ids(backend.tokenizer, USER)
    assert entry.n_tokens == len(entry.response_ids) == resp["usage"]["completion_tokens"] == 6
    assert backend.tokenizer.decode(entry.response_ids.tolist(), skip_special_tokens=True) == (
        resp["choices"][0]["message"]["content"]
    )
    # ℓ^b (incremental KV-cache decode) == Σ log_softmax(logits/1) recomputed by one full forward pass.
    expected = recompute_logprob(reference_model, entry.prompt_ids, entry.response_ids)
    assert entry.behaviour_logprob == pytest.approx(expected, abs=1e-4)
    assert claas["behaviour_logprob"] == pytest.approx(entry.behaviour_logprob, abs=1e-12)


def test_eos_token_is_part_of_the_response_and_its_logprob(backend, reference_model):
    """A response that stops on EOS keeps the EOS token (it carries mask 1) and its log-prob is in the sum."""
    buf = big_buffer()
    saved = backend.eos_token_ids
    backend.eos_token_ids = set(range(len(backend.tokenizer)))  # every token ends the response: stop after one
    try:
        with running_service(backend, buf) as (_, url), ClaasServiceClient(url) as client:
            resp = client.chat(USER, max_tokens=6)
            assert client.feedback(resp["id"], 0.0)["status"] == "accepted"
    finally:
        backend.eos_token_ids = saved
    assert resp["choices"][0]["finish_reason"] == "stop"
    [entry] = buf.entries()
    assert entry.n_tokens == 1
    expected = recompute_logprob(reference_model, entry.prompt_ids, entry.response_ids)
    assert entry.behaviour_logprob == pytest.approx(expected, abs=1e-4) and expected < 0


def test_feedback_flow_and_unknown_ids(backend):
    buf = big_buffer()
    with running_service(backend, buf) as (service, url), ClaasServiceClient(url) as client:
        resp = client.chat(USER, scenario_id=3, max_tokens=4, metadata={"session": "abc"})
        rid = resp["id"]
        assert resp["claas"]["record"] == "pending_feedback"
        assert len(buf) == 0 and client.stats()["pending_now"] == 1
        out = client.feedback(rid, 0.0, "you revealed the word")
        assert out == {"request_id": rid, "status": "accepted", "reason": None}
        # The same id twice: 404, counted, nothing added.
        again = httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": 1.0})
        assert again.status_code == 404 and again.json()["status"] == "unknown"
        bad = httpx.post(f"{url}/v1/feedback", json={"request_id": rid})
        assert bad.status_code == 400 and "'reward' is required" in bad.json()["error"]["message"]
        stats = client.stats()
    [entry] = buf.entries()
    assert (entry.uid, entry.reward, entry.feedback, entry.scenario_id) == (rid, 0.0, "you revealed the word", 3)
    assert entry.metadata["client"] == {"session": "abc"}
    assert (stats["pending"], stats["submitted"], stats["feedback_unknown"], stats["pending_now"]) == (1, 1, 1, 0)
    assert stats["sink"]["accepted"] == 1


def test_reward_none_is_dropped_from_feedback_and_from_graders(backend):
    buf = big_buffer()
    with running_service(backend, buf) as (_, url), ClaasServiceClient(url) as client:
        rid = client.chat(USER, max_tokens=3)["id"]
        assert client.feedback(rid, None)["status"] == "dropped"
        assert client.stats()["dropped_reward_none"] == 1
    assert len(buf) == 0

    def crashing(visible, context):
        raise GraderError("sandbox timed out")

    # A verifier that errors gives reward None through grade_response (docs/math.md §A.1.4) -> dropped, never inserted.
    with running_service(backend, buf, grader=verifier_grader(crashing), grade_inline=True) as (_, url), \
            ClaasServiceClient(url) as client:
        resp = client.chat(USER, max_tokens=3)
        assert resp["claas"]["record"] == "dropped" and "docs/math.md §A.1.4" in resp["claas"]["reason"]
        assert client.stats()["dropped_reward_none"] == 1

    def raising(request):
        raise RuntimeError("grader bug")

    with running_service(backend, buf, grader=raising, grade_inline=True) as (_, url), \
            ClaasServiceClient(url) as client:
        resp = client.chat(USER, max_tokens=3)
        assert resp["claas"]["record"] == "dropped" and "grader bug" in resp["claas"]["reason"]
        assert client.stats()["dropped_grader_error"] == 1
    assert len(buf) == 0


def test_verifier_grader_in_background_records_after_the_response(backend):
    buf = big_buffer()
    seen = []

    def verifier(visible, context):
        seen.append(context)
        return Verdict(passed=False, feedback="too short")

    with running_service(backend, buf, grader=verifier_grader(verifier)) as (_, url), \
            ClaasServiceClient(url) as client:
        resp = client.chat(USER, max_tokens=4)
        assert resp["claas"]["record"] == "grading"
        wait_until(lambda: client.stats()["submitted"] >= 1, "the graded turn to reach the buffer", timeout_s=30)
    [entry] = buf.entries()
    assert (entry.reward, entry.feedback) == (0.0, "too short")
    assert seen == ["What is 2+3?"]  # the grader's context: the concatenated user messages


@pytest.mark.parametrize("params, field", [
    ({"temperature": 0.7}, "temperature=0.7"),
    ({"top_p": 0.9}, "top_p=0.9"),
    ({"top_k": 5}, "top_k=5"),
    ({"temperature": 0.0}, "temperature=0"),
])
def test_non_training_sampling_is_served_but_not_recorded(backend, params, field):
    buf = big_buffer()
    with running_service(backend, buf) as (_, url), ClaasServiceClient(url) as client:
        resp = client.chat(USER, max_tokens=4, **params)
        stats = client.stats()
    assert resp["usage"]["completion_tokens"] >= 1 and resp["choices"][0]["message"]["content"] is not None
    assert resp["claas"]["record"] == "rejected"
    assert "docs/math.md §0" in resp["claas"]["reason"] and field in resp["claas"]["reason"]
    assert (stats["rejected_sampling"], stats["pending_now"], stats["served"]) == (1, 0, 1)
    assert len(buf) == 0


def test_opt_out_header_and_bad_requests(backend):
    buf = big_buffer()
    with running_service(backend, buf) as (_, url):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                       headers={"X-Claas-Record": "0"})
        assert r.status_code == 200 and r.json()["claas"]["record"] == "not_recorded"
        for body, needle in [
            ({"messages": USER, "stream": "yes"}, "'stream'"),
            ({"messages": USER, "n": 2}, "'n' must be 1"),
            ({"messages": []}, "'messages'"),
            ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
            ({"messages": USER, "max_tokens": 0}, "'max_tokens'"),
            ({"messages": USER, "metadata": {"scenario_id": -1}}, "scenario_id"),
            ({"messages": USER, "repetition_penalty": 1.2}, "repetition_penalty"),  # HF backend lacks it
        ]:
            r = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == 400, body
            assert needle in r.json()["error"]["message"], (body, r.json())
        r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        stats = httpx.get(f"{url}/v1/claas/stats").json()
    assert (stats["served"], stats["not_recorded"], stats["pending_now"]) == (1, 1, 0)


def test_pending_turns_time_out(backend):
    buf = big_buffer()
    with running_service(backend, buf, pending_ttl_s=0.3, sweep_interval_s=0.05) as (_, url), \
            ClaasServiceClient(url) as client:
        rid = client.chat(USER, max_tokens=2)["id"]
        wait_until(lambda: client.stats()["dropped_timeout"] >= 1, "the sweeper to drop the unanswered turn")
        assert client.stats()["dropped_timeout"] == 1
        assert httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": 1.0}).status_code == 404
    assert len(buf) == 0


def test_concurrent_requests_are_recorded_exactly_once(backend):
    buf = big_buffer()
    ids: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    with running_service(backend, buf) as (_, url):
        def worker(w: int) -> None:
            try:
                with ClaasServiceClient(url) as client:
                    for i in range(2):
                        resp = client.chat(USER, scenario_id=w, step_idx=i, max_tokens=3)
                        assert client.feedback(resp["id"], float(w % 2))["status"] == "accepted"
                        with lock:
                            ids.append(resp["id"])
            except BaseException as exc:  # surfaced in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = httpx.get(f"{url}/v1/claas/stats").json()
    assert not errors, errors
    assert len(ids) == 16 and len(set(ids)) == 16
    entries = buf.entries()
    assert sorted(e.uid for e in entries) == sorted(ids)  # each request exactly once
    assert sorted((e.scenario_id, e.step_idx) for e in entries) == [(w, i) for w in range(8) for i in range(2)]
    assert all(e.reward == float(e.scenario_id % 2) for e in entries)
    assert (stats["served"], stats["pending"], stats["submitted"], stats["sink"]["accepted"]) == (16, 16, 16, 16)
