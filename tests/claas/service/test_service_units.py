"""Pure pieces of the chat service: the docs/math.md §0 sampling rule, the pending table, the adapter switch,
grading."""

from __future__ import annotations

import math

import pytest

from claas_verl.claas.envs import Grade
from claas_verl.claas.replay import ReplayBuffer
from claas_verl.claas.service import (
    AdapterSwitch,
    LocalBufferSink,
    SamplingParams,
    TrajectoryRecorder,
    TurnRecord,
    behaviour_logprob,
    make_sink,
    normalize_grade,
    scenario_key_to_id,
    training_violations,
)


# ---------------------------------------------------------------- docs/math.md §0 sampling rule
def test_defaults_are_the_training_settings():
    p = SamplingParams.from_request({"messages": []})
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, -1)
    assert training_violations(p) == []
    # top_k=0 is "off" too (vLLM's other spelling) and is normalised to -1.
    assert SamplingParams.from_request({"top_k": 0}).top_k == -1
    assert training_violations(SamplingParams.from_request({"temperature": 1, "top_p": 1, "top_k": -1})) == []


@pytest.mark.parametrize("body, needle", [
    ({"temperature": 0.5}, "temperature=0.5"),
    ({"top_p": 0.95}, "top_p=0.95"),
    ({"top_k": 20}, "top_k=20"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -0.5}, "frequency_penalty"),
    ({"min_p": 0.05}, "min_p"),
    ({"min_tokens": 3}, "min_tokens"),
    ({"logit_bias": {"5": 2.0}}, "logit_bias"),
    ({"stop": "\n"}, "stop strings"),
])
def test_every_distribution_change_is_a_violation(body, needle):
    reasons = training_violations(SamplingParams.from_request(body))
    assert len(reasons) == 1 and needle in reasons[0]


@pytest.mark.parametrize("body, needle", [
    ({"temperature": -1}, "'temperature'"),
    ({"temperature": "hot"}, "'temperature'"),
    ({"top_p": 1.5}, "'top_p'"),
    ({"top_k": -2}, "'top_k'"),
    ({"n": 3}, "'n' must be 1"),
    ({"stream": "yes"}, "'stream'"),
    ({"tools": [{"type": "function"}]}, "'tools'"),
    ({"max_tokens": 1.5}, "'max_tokens'"),
    ({"stop": [1]}, "'stop'"),
    ({"logprobs": "yes"}, "'logprobs'"),
])
def test_bad_sampling_fields_name_the_field(body, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams.from_request(body)


def test_max_completion_tokens_is_an_alias_and_max_tokens_wins():
    assert SamplingParams.from_request({"max_completion_tokens": 7}).max_tokens == 7
    assert SamplingParams.from_request({"max_completion_tokens": 7, "max_tokens": 9}).max_tokens == 9


# ---------------------------------------------------------------- recorder
class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _record(rid: str, logprob: float = -1.5, P: int = 0) -> TurnRecord:
    return TurnRecord(request_id=rid, scenario_id=1, step_idx=0, prompt_ids=[1, 2], response_ids=[3, 4],
                      behaviour_logprob=logprob, policy_version=P)


def test_behaviour_logprob_is_the_exact_sum_clamped_at_zero():
    # -0.5 - 0.25 - 0.125 = -0.875 exactly in binary floating point.
    assert behaviour_logprob([-0.5, -0.25, -0.125]) == -0.875
    # fsum: 1e-16-sized terms are not lost next to a large one (plain sum would give -1.0).
    assert behaviour_logprob([-1.0] + [-1e-16] * 10) == math.fsum([-1.0] + [-1e-16] * 10)
    assert behaviour_logprob([0.0, 1e-7]) == 0.0  # fp16 rounding above 0 is clamped, not stored as positive


def _feedback(rec: TrajectoryRecorder, rid: str, reward, text=None, owner: str = "local"):
    """What the service does for POST /v1/feedback: take the key's pending turn, finish it; ``(status, reason)``."""
    record = rec.take(rid, owner)
    if record is None:
        return "unknown", rec.unknown_reason(rid)
    status, reason, ack = rec.finish(record, reward, text)
    assert ack is None or ack.result(timeout=10) in (0, 1)
    return status, reason


def test_feedback_submits_and_reward_none_drops():
    buf = ReplayBuffer(10, 1, 5)
    rec = TrajectoryRecorder(LocalBufferSink(buf))
    rec.hold(_record("a"))
    rec.hold(_record("b"))
    assert _feedback(rec, "a", 1.0, "fine") == ("submitted", None)
    status, reason = _feedback(rec, "b", None)
    assert status == "dropped" and "docs/math.md §A.1.4" in reason
    assert _feedback(rec, "a", 1.0)[0] == "unknown"
    [entry] = buf.entries()
    assert (entry.uid, entry.reward, entry.feedback, entry.n_tokens) == ("a", 1.0, "fine", 2)
    s = rec.stats()
    assert (s["pending"], s["submitted"], s["dropped_reward_none"], s["feedback_unknown"]) == (2, 1, 1, 1)
    assert buf.stats()["dropped_none"] == 0  # the None never even reached the buffer


def test_pending_timeout_and_overflow_are_counted():
    clock = FakeClock()
    rec = TrajectoryRecorder(LocalBufferSink(ReplayBuffer(10, 1, 5)), max_pending=2, pending_ttl_s=10.0,
                             clock=clock)
    rec.hold(_record("a"))  # deadline 110
    clock.t = 105.0
    rec.hold(_record("b"))  # deadline 115
    rec.hold(_record("c"))  # table full: "a" (the oldest) is dropped
    assert not rec.is_pending("a") and rec.is_pending("b") and rec.is_pending("c")
    clock.t = 115.0  # "b" reaches its deadline (inclusive), "c" (deadline 115 too) as well
    assert rec.sweep() == 2
    s = rec.stats()
    assert (s["dropped_overflow"], s["dropped_timeout"], s["pending_now"]) == (1, 2, 0)
    assert _feedback(rec, "b", 1.0)[0] == "unknown"


def test_invalid_entry_is_rejected_with_the_field_named():
    rec = TrajectoryRecorder(LocalBufferSink(ReplayBuffer(10, 1, 5)))
    rec.hold(_record("x", logprob=0.5))  # a positive "log-prob" is an NLL stored with the wrong sign
    status, reason = _feedback(rec, "x", 1.0)
    assert status == "rejected" and "behaviour_logprob" in reason
    assert rec.stats()["rejected_invalid"] == 1


def test_recorder_arguments_are_validated():
    sink = LocalBufferSink(ReplayBuffer(10, 1, 5))
    with pytest.raises(ValueError, match="max_pending"):
        TrajectoryRecorder(sink, max_pending=0)
    with pytest.raises(ValueError, match="pending_ttl_s"):
        TrajectoryRecorder(sink, pending_ttl_s=0)
    with pytest.raises(ValueError, match="sink must be"):
        make_sink(object())


# ---------------------------------------------------------------- adapter switch
def test_switch_defers_retirement_until_the_last_lease_is_released():
    retired = []
    sw = AdapterSwitch("base", 0, on_retire=retired.append, keep=("base",))
    lease_base = sw.acquire()
    sw.switch("claas-v1", 1)
    assert retired == []  # the base model is never retired
    lease1 = sw.acquire()
    lease1b = sw.acquire()
    assert (lease1.name, lease1.version, lease_base.version) == ("claas-v1", 1, 0)
    sw.switch("claas-v2", 2)
    assert sw.current.name == "claas-v2" and retired == []  # two requests still run on v1
    lease1.release()
    lease1.release()  # releasing twice is a no-op, not a double decrement
    assert retired == [] and sw.inflight("claas-v1") == 1
    lease1b.release()
    assert retired == ["claas-v1"]
    with sw.acquire() as lease2:
        assert lease2.version == 2
    sw.switch("claas-v3", 3)  # nobody on v2: retired at once
    assert retired == ["claas-v1", "claas-v2"]
    with pytest.raises(ValueError, match="version must increase"):
        sw.switch("claas-v0", 3)
    lease_base.release()
    assert retired == ["claas-v1", "claas-v2"]


# ---------------------------------------------------------------- grading and ids
def test_normalize_grade_accepts_the_documented_forms():
    assert normalize_grade(Grade(reward=1.0, feedback=None)) == (1.0, None)
    assert normalize_grade(Grade(reward=None, feedback=None)) == (None, None)
    assert normalize_grade(0) == (0.0, None)
    assert normalize_grade((0.5, "partly")) == (0.5, "partly")
    assert normalize_grade(None) == (None, None)
    for bad in (float("nan"), True, "1.0", (1.0, 3)):
        with pytest.raises(ValueError):
            normalize_grade(bad)


def test_scenario_keys_map_to_stable_ints():
    assert scenario_key_to_id(5) == (5, None)
    assert scenario_key_to_id("12") == (12, None)
    sid, key = scenario_key_to_id("ih-challenge/0042")
    assert key == "ih-challenge/0042" and 0 <= sid < 2**31
    assert scenario_key_to_id("ih-challenge/0042")[0] == sid  # stable across calls (crc32, not hash())
    for bad in (-1, "", True, 1.5):
        with pytest.raises(ValueError, match="scenario_id"):
            scenario_key_to_id(bad)


def test_the_vllm_server_is_started_with_an_api_key_kept_off_its_command_line(tmp_path):
    from claas_verl.claas.service.vllm_launcher import VLLMServer

    server = VLLMServer(tmp_path, device="cpu", log_path=tmp_path / "log")
    other = VLLMServer(tmp_path, device="cpu", log_path=tmp_path / "log")
    assert len(server.api_key) >= 32 and server.api_key != other.api_key  # a fresh key per server
    assert server.environment()["VLLM_API_KEY"] == server.api_key
    assert server.api_key not in " ".join(server.command())  # not readable from the process list
    assert VLLMServer(tmp_path, device="cpu", log_path=tmp_path / "log", api_key="k").environment()["VLLM_API_KEY"] \
        == "k"
