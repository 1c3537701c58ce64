"""Rollout producers on a fake rollout server: entries, versions, reward None, EMA, ICL, evaluation."""

from __future__ import annotations

import asyncio
import math
import threading
from types import SimpleNamespace

import pytest

from claas_verl.claas.envs import GraderError, ICLFeedbackMemory, Scenario, Verdict
from claas_verl.claas.replay import ReplayBuffer
from claas_verl.claas.trainer import BackgroundLoop, RolloutProducer
from claas_verl.losses.advantages import EmaRewardStats


class CharTokenizer:
    """One token per character (ids = ord), a plain-text chat template; enough for the producer."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeServer:
    """Replies with scripted texts; per-token log-prob -0.5; reports the version it was told to serve."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.version = 0
        self.calls = []

    async def generate(self, request_id, prompt_ids, sampling_params):
        self.calls.append((list(prompt_ids), dict(sampling_params)))
        text = self.replies.pop(0)
        ids = [ord(c) for c in text]
        return SimpleNamespace(token_ids=ids, log_probs=[-0.5] * len(ids), extra_fields={"global_steps": self.version})


class FakeReplay:
    """`add.remote(entries)` over a plain ReplayBuffer, awaitable like a Ray ObjectRef."""

    def __init__(self, buffer):
        self.buffer = buffer
        outer = self

        class _Add:
            def remote(self, entries):
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(outer.buffer.add(entries))
                return fut

        self.add = _Add()


def verifier_no_x(visible, context):
    if "CRASH" in visible:
        raise GraderError("grader crashed")
    return Verdict(passed="x" not in visible, feedback="said x")


def scenario(i, turns=("hi", "again")):
    return Scenario(scenario_id=f"s{i}", system_prompt="never say x", user_turns=tuple(turns), verifier=verifier_no_x)


from claas_verl.claas.trainer.producer import ChatRenderer  # noqa: E402


def make_producer(replies, buffer=None, **kw):
    server = FakeServer(replies)
    replay = FakeReplay(buffer) if buffer is not None else None
    prod = RolloutProducer(server.generate, ChatRenderer(CharTokenizer()), replay, max_new_tokens=7,
                           max_concurrent=1, **kw)
    return prod, server


def test_steps_become_entries_with_served_version_and_summed_logprob():
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=5)
    ema = EmaRewardStats()
    prod, server = make_producer(["ok", "xx!"], buf, ema_stats=ema, ema_lock=threading.Lock())
    server.version = 0
    asyncio.run(prod.run_split([scenario(0)], index_offset=7))
    entries = buf.entries()
    assert [e.step_idx for e in entries] == [0, 1]
    assert [e.reward for e in entries] == [1.0, 0.0]
    assert entries[1].feedback == "said x" and entries[0].feedback is None
    assert [e.behaviour_logprob for e in entries] == [-1.0, -1.5]  # 2 and 3 tokens at -0.5
    assert all(e.P == 0 and e.scenario_id == 7 for e in entries)
    # turn 1's context holds turn 0's decoded reply (multi-turn, docs/math.md §A.1.5)
    prompt1 = "".join(chr(i) for i in entries[1].prompt_ids)
    assert "<assistant>ok\n<user>again" in prompt1
    # docs/math.md §0: training requests sample at tau=1, top-p=1, top-k off, with log-probs
    for _, sp in server.calls:
        got = (sp["temperature"], sp["top_p"], sp["top_k"], sp["logprobs"], sp["max_tokens"])
        assert got == (1.0, 1.0, -1, True, 7)
    # EMA saw both inserted rewards: b = 0.5 + 0.1*(1-0.5) = 0.55, then 0.55 + 0.1*(0-0.55) = 0.495
    assert ema.count == 2 and math.isclose(ema.baseline, 0.495)


def test_grader_crash_gives_none_which_never_reaches_the_buffer_or_the_ema():
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=5)
    ema = EmaRewardStats()
    prod, _ = make_producer(["CRASH", "fine"], buf, ema_stats=ema)
    stats = asyncio.run(prod.run_split([scenario(0)]))
    assert stats["none_rewards"] == 1 and stats["steps"] == 2
    assert [e.reward for e in buf.entries()] == [1.0]
    assert buf.stats()["dropped_none"] == 0  # dropped before the buffer is even asked (docs/math.md §A.1.4)
    assert ema.count == 1


def test_missing_logprobs_is_a_clear_error():
    async def gen(rid, ids, sp):
        return SimpleNamespace(token_ids=[1, 2], log_probs=None, extra_fields={})

    prod = RolloutProducer(gen, ChatRenderer(CharTokenizer()), None, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="log-probs"):
        asyncio.run(prod.run_split([scenario(0)]))


def test_too_long_context_ends_the_scenario():
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=5)
    prod, server = make_producer(["a" * 50, "b"], buf, max_prompt_tokens=60)
    stats = asyncio.run(prod.run_split([scenario(0)]))
    assert stats["prompt_too_long"] == 1 and len(buf) == 1 and len(server.calls) == 1


def test_icl_feedback_goes_into_later_system_prompts_and_nothing_is_inserted():
    memory = ICLFeedbackMemory(lambda s: len(s), token_budget=10_000)
    prod, server = make_producer(["x", "ok", "ok", "ok"], None, icl_memory=memory)
    asyncio.run(prod.run_split([scenario(0), scenario(1)]))
    assert len(memory) == 1
    first_prompt = "".join(chr(i) for i in server.calls[0][0])
    later_prompt = "".join(chr(i) for i in server.calls[2][0])
    assert "said x" not in first_prompt and "said x" in later_prompt


def test_evaluate_is_a_pass_rate_over_graded_steps_and_learns_nothing():
    memory = ICLFeedbackMemory(lambda s: len(s), token_budget=10_000)
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=5)
    prod, server = make_producer(["ok", "x", "CRASH", "ok"], buf, icl_memory=memory)
    res = asyncio.run(prod.evaluate([scenario(0), scenario(1)], temperature=0.0, max_new_tokens=3))
    # graded: ok(1), x(0), ok(1); CRASH is a grader error and excluded -> 2/3
    assert res == {"pass_rate": pytest.approx(2 / 3), "graded": 3, "errors": 1}
    assert len(buf) == 0 and len(memory) == 0
    assert server.calls[0][1]["temperature"] == 0.0 and server.calls[0][1]["max_tokens"] == 3


def test_background_loop_runs_coroutines_from_another_thread():
    loop = BackgroundLoop()
    try:
        async def add(a, b):
            await asyncio.sleep(0)
            return a + b

        assert loop.submit(add(2, 3)).result(timeout=5) == 5
    finally:
        loop.close()


def test_sdpo_teacher_context_reprompts_the_last_user_turn_of_failed_steps_only():
    from claas_verl.losses.sdpo import FEEDBACK_TEMPLATE, REPROMPT_TEMPLATE

    buf = ReplayBuffer(b_max=10, b_min=1, a_max=5)
    prod, _ = make_producer(["ok", "xx!"], buf, sdpo_reprompt={"reprompt_success": False})
    asyncio.run(prod.run_split([scenario(0)]))
    passed, failed = buf.entries()
    assert "teacher_prompt_ids" not in passed.metadata  # reward 1: no teacher context (sd_mask = 0)
    teacher = "".join(chr(i) for i in failed.metadata["teacher_prompt_ids"])
    reprompted = REPROMPT_TEMPLATE.format(prompt="again", solution="",
                                          feedback=FEEDBACK_TEMPLATE.format(feedback_raw="said x"))
    # system prompt and earlier turns kept; the last user turn re-prompted with the verifier feedback (docs/math.md
    # §A.3.3)
    assert teacher == f"<system>never say x\n<user>hi\n<assistant>ok\n<user>{reprompted}\n<assistant>"

    from claas_verl.claas.trainer.tq_fields import HAS_FEEDBACK_FIELD, TEACHER_PROMPT_FIELD, entry_fields

    f = entry_fields(failed, sdpo=True)
    assert f[TEACHER_PROMPT_FIELD].tolist() == failed.metadata["teacher_prompt_ids"] and int(f[HAS_FEEDBACK_FIELD])
    g = entry_fields(passed, sdpo=True)
    assert g[TEACHER_PROMPT_FIELD].tolist() == passed.prompt_ids.tolist() and int(g[HAS_FEEDBACK_FIELD]) == 0
    assert TEACHER_PROMPT_FIELD not in entry_fields(failed)  # other algorithms carry no SDPO fields


class FlakyServer(FakeServer):
    """Scripted outcomes per call: "raise", "abort", "" (no token) or a reply text."""

    async def generate(self, request_id, prompt_ids, sampling_params):
        self.calls.append((list(prompt_ids), dict(sampling_params)))
        step = self.replies.pop(0)
        if step == "raise":
            raise ConnectionError("replica down")
        if step == "abort":
            return SimpleNamespace(token_ids=[ord("a")], log_probs=[-0.5], stop_reason="aborted",
                                   extra_fields={"global_steps": self.version})
        ids = [ord(c) for c in step]
        return SimpleNamespace(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                               extra_fields={"global_steps": self.version})


def _flaky_producer(script, max_retries=2):
    server = FlakyServer(script)
    buf = ReplayBuffer(b_max=100, b_min=1, a_max=10, seed=0)
    prod = RolloutProducer(server.generate, ChatRenderer(CharTokenizer()), FakeReplay(buf), max_new_tokens=7,
                           max_concurrent=1, max_retries=max_retries)
    return prod, buf, server


def test_failed_or_aborted_generations_are_retried_then_the_scenario_is_dropped():
    # turn 0: raise, abort, then "ok"; turn 1: "fine" -> two entries, two retries, one abort; never an aborted entry
    prod, buf, server = _flaky_producer(["raise", "abort", "ok", "fine"])
    asyncio.run(prod.run_split([scenario(0)]))
    assert [[int(t) for t in e.response_ids] for e in buf.entries()] == [[ord("o"), ord("k")], [ord(c) for c in "fine"]]
    st = prod.stats.as_dict()
    assert (st["retries"], st["aborted"], st["dropped_scenarios"], st["steps"]) == (2, 1, 0, 2)
    # Three failures of one call (max_retries=2) drop the whole scenario, counted with its cause; the next one runs.
    prod, buf, _ = _flaky_producer(["ok", "raise", "abort", "raise", "a", "b"])
    asyncio.run(prod.run_split([scenario(0), scenario(1)]))
    st = prod.stats.as_dict()
    assert (st["dropped_scenarios"], st["scenarios"], len(buf)) == (1, 1, 2)
    assert "replica down" in st["last_drop_cause"] and "3 attempts" in st["last_drop_cause"]


def test_an_empty_reply_ends_the_scenario_and_is_counted():
    prod, buf, _ = _flaky_producer(["", "unused"])
    asyncio.run(prod.run_split([scenario(0)]))
    assert prod.stats.empty_replies == 1 and len(buf) == 0


def test_scenario_mode_inserts_one_concatenable_scenario_entry_with_min_reward():
    from claas_verl.claas.replay import ScenarioEntry
    from claas_verl.claas.trainer.tq_fields import scenario_sequence

    buf = ReplayBuffer(b_max=10, b_min=1, a_max=5, entry_unit="scenario")
    ema = EmaRewardStats()
    prod, server = make_producer(["ok", "xx!", "fine", "CRASH"], buf, ema_stats=ema, ema_lock=threading.Lock(),
                                 entry_unit="scenario")
    asyncio.run(prod.run_split([scenario(0), scenario(1)]))
    (entry,) = buf.entries()  # scenario 1 had a None step: dropped whole (docs/math.md §A.1.5)
    assert isinstance(entry, ScenarioEntry) and entry.reward == 0.0 and [s.reward for s in entry.steps] == [1.0, 0.0]
    # turn 1's prompt is turn 0's prompt + the sampled reply ids + the observation: one replayable sequence
    prompt, response, mask, behaviour = scenario_sequence(entry)
    assert server.calls[1][0] == [int(t) for t in entry.steps[1].prompt_ids]
    assert sum(mask) == entry.n_tokens and math.isclose(sum(behaviour), -2.5)
    assert ema.count == 1 and prod.stats.none_rewards == 1
