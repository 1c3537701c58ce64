"""SDPO through the chat API: the user's feedback text becomes the entry's teacher context (real HTTP, the real
``openai`` client, the tiny policy's own tokenizer and chat template; the job's rollout backend over a scripted
server). The rule is stated in ``claas_verl/claas/service/teacher.py`` and docs/service.md; each case of it is here:

- text with reward null (text-only feedback) and text with a constant reward 0: x' = the last user message
  re-prompted with the text (the unsuccessful-attempt template), rendered with the policy's template; sd_mask = 1;
- text with reward 1: no teacher context unless ``reprompt_success`` (then the success template); the response says so;
- no text (reward 0): an entry with sd_mask = 0; reward null without text: dropped (docs/math.md §A.1.4);
- without SDPO the service is unchanged: reward null drops the turn even with text.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from openai import OpenAI
from service_helpers import big_buffer, running_service

from claas_verl.claas.service.rollout_backend import RolloutBackend
from claas_verl.claas.service.teacher import TEACHER_IDS_KEY, TEXT_ONLY_KEY, SdpoTeacherContext
from claas_verl.claas.service.templating import render_prompt_ids
from claas_verl.claas.trainer.tq_fields import HAS_FEEDBACK_FIELD, TEACHER_PROMPT_FIELD, entry_fields
from claas_verl.losses.sdpo import reprompt
from claas_verl.tiny import ensure_tiny

RULE = "Start your reply with a capital letter."
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny().student))


def _backend(tokenizer) -> RolloutBackend:
    async def generate(request_id, prompt_ids, sampling):  # the rollout server: "hello" + EOS, a lowercase reply
        ids = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
        return SimpleNamespace(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                               extra_fields={"global_steps": 0})

    return RolloutBackend(generate, tokenizer, default_max_tokens=8, max_model_len=2048)


def _turn(client: OpenAI, url: str, question: str, reward, feedback) -> dict:
    messages = [SYSTEM, {"role": "user", "content": question}]
    r = client.chat.completions.create(model="claas", messages=messages)
    claas = r.model_extra["claas"]
    assert claas["record"] == "pending_feedback", claas
    body = {"request_id": claas["request_id"], "reward": reward, "feedback": feedback}
    out = httpx.post(f"{url}/v1/feedback", json=body).json()
    return {"id": claas["request_id"], "messages": messages, **out}


def test_feedback_text_becomes_the_sdpo_teacher_context(tokenizer):
    buf = big_buffer()
    with running_service(_backend(tokenizer), buf, teacher=SdpoTeacherContext(tokenizer)) as (service, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        text_only = _turn(client, url, "what is a prime number?", None, RULE)
        constant = _turn(client, url, "name a colour", 0, RULE)
        passing = _turn(client, url, "say hi", 1, RULE)
        no_text = _turn(client, url, "count to three", 0, None)
        dropped = _turn(client, url, "one more", None, None)
        stats = service.stats()
    assert [t["status"] for t in (text_only, constant, passing, no_text)] == ["accepted"] * 4
    assert text_only["reason"] is None and constant["reason"] is None
    assert "reprompt_success" in passing["reason"] and "sd_mask = 0" in no_text["reason"]
    assert dropped["status"] == "dropped" and stats["dropped_reward_none"] == 1

    entries = {e.uid: e for e in buf.entries()}
    assert len(entries) == 4
    for turn in (text_only, constant):
        e = entries[turn["id"]]
        # x': the same chat with the last user message re-prompted with the user's text, in the policy's template
        teacher_msgs = [SYSTEM, {"role": "user", "content": reprompt(turn["messages"][-1]["content"], RULE)}]
        assert e.metadata[TEACHER_IDS_KEY] == render_prompt_ids(tokenizer, teacher_msgs)
        decoded = tokenizer.decode(e.metadata[TEACHER_IDS_KEY])
        assert ("The following is feedback from your unsuccessful earlier attempt:\n\n" + RULE) in decoded
        assert decoded.count(turn["messages"][-1]["content"]) == 1 and e.feedback == RULE
        fields = entry_fields(e, sdpo=True)
        assert int(fields[HAS_FEEDBACK_FIELD]) == 1
        assert fields[TEACHER_PROMPT_FIELD].tolist() == e.metadata[TEACHER_IDS_KEY]
        assert fields["prompts"].tolist() != fields[TEACHER_PROMPT_FIELD].tolist()
    # text-only: reward 0 stored and marked (SDPO never reads it; the REINFORCE++ statistics skip it)
    assert entries[text_only["id"]].reward == 0.0 and entries[text_only["id"]].metadata[TEXT_ONLY_KEY] is True
    assert entries[constant["id"]].reward == 0.0 and TEXT_ONLY_KEY not in entries[constant["id"]].metadata
    for turn, reward in ((passing, 1.0), (no_text, 0.0)):
        e = entries[turn["id"]]
        assert e.reward == reward and TEACHER_IDS_KEY not in e.metadata
        assert int(entry_fields(e, sdpo=True)[HAS_FEEDBACK_FIELD]) == 0  # sd_mask = 0: no SDPO signal


def test_reprompt_success_uses_a_passing_turns_feedback(tokenizer):
    buf = big_buffer()
    teacher = SdpoTeacherContext(tokenizer, reprompt_success=True)
    with running_service(_backend(tokenizer), buf, teacher=teacher) as (_, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        passing = _turn(client, url, "say hi", 1, "Nice, keep the capital letter.")
    assert passing["status"] == "accepted" and passing["reason"] is None
    (e,) = buf.entries()
    decoded = tokenizer.decode(e.metadata[TEACHER_IDS_KEY])
    assert "feedback from your successful earlier attempt:\n\nNice, keep the capital letter." in decoded


def test_without_sdpo_reward_null_still_drops_the_turn(tokenizer):
    buf = big_buffer()
    with running_service(_backend(tokenizer), buf) as (service, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        text_only = _turn(client, url, "what is a prime number?", None, RULE)
        rewarded = _turn(client, url, "name a colour", 0, RULE)
        stats = service.stats()
    assert text_only["status"] == "dropped" and stats["dropped_reward_none"] == 1
    assert rewarded["status"] == "accepted"
    (e,) = buf.entries()
    assert e.feedback == RULE and TEACHER_IDS_KEY not in e.metadata and TEXT_ONLY_KEY not in e.metadata
