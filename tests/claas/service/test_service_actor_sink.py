"""Writes to a ReplayBufferActor: through a real Ray actor, and non-blocking for the client (slow fake handle).

The backend is a scripted ``ChatBackend`` (the interface is pluggable), so these tests need no model.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import ray
from service_helpers import USER, running_service

from claas_verl.claas.replay import PackedEntries, ReplayBufferActor
from claas_verl.claas.service import ActorSink, ChatBackend, ClaasServiceClient, Generation, make_sink


class ScriptedBackend(ChatBackend):
    """Answers every chat with the same three tokens; log-probs -1, -2, -3 (Σ = -6)."""

    def __init__(self):
        self._version = 0

    @property
    def served_model(self):
        return f"scripted-v{self._version}"

    @property
    def policy_version(self):
        return self._version

    async def generate(self, messages, params, chat_template_kwargs=None):
        return Generation(prompt_ids=[1, 2, 3], response_ids=[7, 8, 2], token_logprobs=[-1.0, -2.0, -3.0],
                          text="ok", finish_reason="stop", policy_version=self._version, model=self.served_model)

    async def load_adapter(self, path, version=None):
        self._version = self._version + 1 if version is None else version
        return self._version


def test_entries_reach_the_ray_actor_exactly_once(ray_session):
    actor = ReplayBufferActor.remote(b_max=100, b_min=4, a_max=10, seed=0)
    sink = make_sink(actor)
    assert isinstance(sink, ActorSink)
    with running_service(ScriptedBackend(), sink) as (service, url), ClaasServiceClient(url) as client:
        ids = []
        for i in range(5):
            r = client.chat(USER, scenario_id=i)
            ids.append(r["id"])
            client.feedback(r["id"], None if i == 4 else 1.0)  # the fifth: reward None, dropped before the actor
        assert sink.flush(60)
        stats = client.stats()
    assert stats["sink"] == {"submitted": 4, "accepted": 4, "errors": 0, "in_flight": 0}
    assert stats["dropped_reward_none"] == 1
    assert ray.get(actor.wait_ready.remote(10.0)) is True
    entries = ray.get(actor.entries.remote())
    assert sorted(e.uid for e in entries) == sorted(ids[:4])
    assert all(e.behaviour_logprob == -6.0 and e.n_tokens == 3 and e.P == 0 for e in entries)
    assert ray.get(actor.stats.remote())["dropped_none"] == 0  # never sent, so the actor never saw it


class _SlowRef:
    def __init__(self, fut):
        self._fut = fut

    def future(self):
        return self._fut


class SlowActorHandle:
    """Stands in for an actor whose ``add`` takes ``delay_s`` (a busy buffer)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.received = []
        outer = self

        class _Add:
            @staticmethod
            def remote(entries):
                fut = concurrent.futures.Future()

                def finish():
                    time.sleep(outer.delay_s)
                    # the sink ships step entries as one columnar batch, as a real actor receives them
                    outer.received.extend(entries.to_entries() if isinstance(entries, PackedEntries) else entries)
                    fut.set_result(len(entries))

                threading.Thread(target=finish, daemon=True).start()
                return _SlowRef(fut)

        self.add = _Add()


def test_a_slow_buffer_delays_only_the_feedback_it_acknowledges():
    """A busy buffer (a 3 s write) never delays a chat or /health; the feedback is answered ``accepted`` only once the
    write completed, so an acknowledged reward is in the buffer."""
    handle = SlowActorHandle(delay_s=3.0)
    sink = make_sink(handle)
    with running_service(ScriptedBackend(), sink) as (_, url), ClaasServiceClient(url) as client:
        r = client.chat(USER)
        out = {}
        waiter = threading.Thread(target=lambda: out.update(fb=client.feedback(r["id"], 1.0)))
        t0 = time.monotonic()
        waiter.start()
        time.sleep(0.5)
        assert client.health()["status"] == "ok" and client.chat(USER)["claas"]["record"] == "pending_feedback"
        assert time.monotonic() - t0 < 2.0 and "fb" not in out and handle.received == []
        waiter.join(30)
        assert out["fb"]["status"] == "accepted" and time.monotonic() - t0 >= 3.0
    assert [e.uid for e in handle.received] == [r["id"]]
    assert sink.stats() == {"submitted": 1, "accepted": 1, "errors": 0, "in_flight": 0}


def test_on_accepted_sees_only_what_the_buffer_accepted(ray_session):
    """The training job feeds the EMA baseline from on_accepted: a duplicate write must not count twice."""
    from claas_verl.claas.replay import ReplayEntry

    actor = ReplayBufferActor.remote(b_max=100, b_min=1, a_max=10, seed=0)
    seen = []
    sink = ActorSink(actor, on_accepted=lambda entries, n: seen.append(([e.reward for e in entries], n)))
    e = ReplayEntry(uid="u1", scenario_id=0, step_idx=0, prompt_ids=[1], response_ids=[2], behaviour_logprob=-1.0,
                    reward=1.0, P=0)
    sink.submit([e])
    assert sink.flush(30)
    sink.submit([e])  # the same uid again: the buffer skips it (duplicate), the callback is not called
    assert sink.flush(30)
    assert seen == [([1.0], 1)] and sink.stats()["accepted"] == 1 and sink.callback_errors == 0
