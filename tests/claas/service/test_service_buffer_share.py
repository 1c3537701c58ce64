"""Each API key's share of the replay buffer, over real HTTP on 127.0.0.1: a key holding its share is refused (429,
``Retry-After``, the turn kept for a retry) instead of pushing another key's entries out of the buffer; other keys
still write, and the key writes again once room was made. A key alone, or free space, is never refused."""

from __future__ import annotations

import threading

import httpx
import pytest
from service_helpers import ADMIN, USER, Scripted, running_service

from claas_verl.claas.replay import ReplayBuffer
from claas_verl.claas.service import ServiceConfig
from claas_verl.claas.trainer.config import ServiceSection

KEY_A, KEY_B = "sk-alice", "sk-bob"


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _turn(url: str, key: str) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}, headers=_auth(key), timeout=30)
    assert r.status_code == 200 and r.json()["claas"]["record"] == "pending_feedback"
    return r.json()["id"]


def _reward(url: str, rid: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/feedback", json={"request_id": rid, "reward": 1}, headers=_auth(key), timeout=30)


def _small_buffer() -> ReplayBuffer:
    return ReplayBuffer(b_max=4, b_min=1, a_max=1000, seed=0)


def test_a_key_at_its_share_is_refused_others_still_write_and_it_writes_again_once_pushed_out():
    buf = _small_buffer()
    with running_service(Scripted(), buf, api_keys=(KEY_A, KEY_B), max_buffer_share=0.5) as (service, url):
        bob = [_turn(url, KEY_B) for _ in range(2)]
        alice = [_turn(url, KEY_A) for _ in range(3)]
        assert [_reward(url, rid, KEY_B).json()["status"] for rid in bob] == ["accepted"] * 2
        assert [_reward(url, rid, KEY_A).json()["status"] for rid in alice[:2]] == ["accepted"] * 2
        # the buffer is full (2 + 2) and its oldest entry is Bob's: Alice's third would push it out
        refused = _reward(url, alice[2], KEY_A)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        message = refused.json()["error"]["message"]
        assert "max_buffer_share=0.5" in message and "claas.service.max_buffer_share" in message
        assert "2 of 4 entries" in message
        assert service.recorder.is_pending(alice[2])  # nothing lost: the turn waits for a retry
        assert [e.uid for e in buf.entries()] == bob + alice[:2]
        # Bob, also at his share, only pushes his own oldest entries out: accepted
        bob += [_turn(url, KEY_B) for _ in range(2)]
        assert [_reward(url, rid, KEY_B).json()["status"] for rid in bob[2:]] == ["accepted"] * 2
        # Bob's new entries pushed his old ones out; Alice's oldest is next to go: her retry is accepted
        retried = _reward(url, alice[2], KEY_A)
        assert retried.status_code == 200 and retried.json()["status"] == "accepted"
        mine = httpx.get(f"{url}/v1/claas/stats", headers=_auth(KEY_A)).json()
        admin = httpx.get(f"{url}/v1/claas/stats", headers=_auth(ADMIN)).json()
        metrics = httpx.get(f"{url}/metrics", headers=_auth(ADMIN)).text
    assert [e.uid for e in buf.entries()] == [alice[1], bob[2], bob[3], alice[2]]
    assert mine["rejected_buffer_share"] == 1 and mine["accepted"] == 3
    assert mine["buffer_share"] == {"max": 0.5, "limit": 2, "held": 2}
    assert admin["rejected_buffer_share"] == 1 and admin["turns"]["dropped"]["rejected_buffer_share"] == 1
    kid = mine["key_id"]
    assert admin["keys"][kid]["rejected_buffer_share"] == 1 and admin["buffer_share"]["held"][kid] == 2
    for line in ('claas_turns_dropped_total{reason="rejected_buffer_share"} 1.0',
                 f'claas_key_turns_total{{key_id="{kid}",outcome="rejected_buffer_share"}} 1.0',
                 f'claas_key_buffer_entries{{key_id="{kid}"}} 2.0'):
        assert line in metrics, line


def test_free_space_and_a_key_alone_are_never_refused():
    buf = _small_buffer()
    with running_service(Scripted(), buf, api_keys=(KEY_A, KEY_B), max_buffer_share=0.25) as (service, url):
        rids = [_turn(url, KEY_A) for _ in range(7)]
        # beyond its share while the buffer has room, then pushing out only its own entries
        assert [_reward(url, rid, KEY_A).json()["status"] for rid in rids] == ["accepted"] * 7
    assert [e.uid for e in buf.entries()] == rids[-4:] and service.recorder.stats()["rejected_buffer_share"] == 0


def test_concurrent_feedback_of_one_key_cannot_overshoot_its_share():
    buf = _small_buffer()
    with running_service(Scripted(), buf, api_keys=(KEY_A, KEY_B), max_buffer_share=0.5) as (service, url):
        bob = [_turn(url, KEY_B) for _ in range(2)]
        assert [_reward(url, rid, KEY_B).json()["status"] for rid in bob] == ["accepted"] * 2
        alice = [_turn(url, KEY_A) for _ in range(6)]
        codes: list[int] = []
        threads = [threading.Thread(target=lambda r=rid: codes.append(_reward(url, r, KEY_A).status_code))
                   for rid in alice]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(codes) == [200, 200] + [429] * 4
    held = [e.uid for e in buf.entries() if e.uid in alice]
    assert len(held) == 2 and all(e.uid in held or e.uid in bob for e in buf.entries())


def test_a_graded_turn_beyond_the_share_is_dropped_and_counted():
    buf = _small_buffer()
    with running_service(Scripted(), buf, grader=lambda request: 1.0, grade_inline=True,
                         api_keys=(KEY_A, KEY_B), max_buffer_share=0.5) as (service, url):
        def chat(key):
            return httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}, headers=_auth(key),
                              timeout=30).json()["claas"]

        assert [chat(KEY_B)["record"] for _ in range(2)] + [chat(KEY_A)["record"] for _ in range(2)] \
            == ["accepted"] * 4
        third = chat(KEY_A)
    assert third["record"] == "dropped" and "max_buffer_share=0.5" in third["reason"]
    assert service.recorder.stats()["dropped_buffer_share"] == 1 and len(buf) == 4


@pytest.mark.parametrize("value", [0, -0.1, 1.5, True, "half", float("nan")])
def test_the_share_is_a_fraction_in_0_1_and_the_error_names_the_field(value):
    with pytest.raises(ValueError, match="max_buffer_share"):
        ServiceConfig(api_keys=(KEY_A,), max_buffer_share=value)
    with pytest.raises(ValueError, match="claas.service.max_buffer_share"):
        ServiceSection(max_buffer_share=value)


def test_a_share_needs_a_sink_that_reports_the_buffers_fill():
    class Opaque:
        def submit(self, entries):
            raise AssertionError("never written")

        def flush(self, timeout_s=10.0):
            return True

        def stats(self):
            return {}

    from claas_verl.claas.service import ChatService

    with pytest.raises(ValueError, match="max_buffer_share=0.5 needs a sink"):
        ChatService(Scripted(), Opaque(), config=ServiceConfig(api_keys=(KEY_A,), max_buffer_share=0.5))
    ChatService(Scripted(), Opaque(), config=ServiceConfig(api_keys=(KEY_A,)))  # the default asks nothing of it


def test_the_share_holds_against_a_replay_actor(ray_session):
    """The training job's path: the actor sink reports the actor's fill; the share refuses as with a local buffer."""
    import ray

    from claas_verl.claas.replay import ReplayBufferActor

    actor = ReplayBufferActor.remote(b_max=2, b_min=1, a_max=1000, seed=0)
    assert ray.get(actor.size.remote(), timeout=120) == 0  # started (the first call waits for the worker)
    with running_service(Scripted(), actor, api_keys=(KEY_A, KEY_B), max_buffer_share=0.5) as (service, url):
        assert service.recorder.sink.fill() == (0, 2)
        assert _reward(url, _turn(url, KEY_B), KEY_B).json()["status"] == "accepted"
        assert _reward(url, _turn(url, KEY_A), KEY_A).json()["status"] == "accepted"
        assert _reward(url, _turn(url, KEY_A), KEY_A).status_code == 429  # would push Bob's entry out
        assert _reward(url, _turn(url, KEY_B), KEY_B).json()["status"] == "accepted"  # Bob pushes his own out
        stats = httpx.get(f"{url}/v1/claas/stats", headers=_auth(ADMIN)).json()
    assert stats["rejected_buffer_share"] == 1 and stats["buffer_share"]["limit"] == 1
    assert sorted(stats["buffer_share"]["held"].values()) == [1, 1]
