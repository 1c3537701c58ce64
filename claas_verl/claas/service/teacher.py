"""SDPO's teacher context for a chat turn: the user's feedback text re-prompted into the turn's last user message.

A job with ``claas.algorithm=sdpo`` builds, for every turn that gets feedback text (``POST /v1/feedback``, or a
grader's feedback), the teacher context x' of docs/math.md §A.3.3 exactly as the scenario producers do
(:func:`claas_verl.losses.sdpo.teacher_messages`, then the policy's chat template), and stores its token ids in
the entry's ``metadata["teacher_prompt_ids"]``, the field the trainer reads (``tq_fields.entry_fields``). A turn
without a teacher context trains with sd_mask = 0 (no SDPO signal), as in the benchmark.

The rule (docs/math.md §A.3.3, and for the service docs/service.md "SDPO through the chat API"):

* feedback text with a reward < 1: the unsuccessful-attempt template;
* feedback text with reward ``null`` (text-only feedback): the user's words are the signal, so the turn is taken as
  not passed: the same unsuccessful-attempt template; the entry stores reward 0 and ``metadata["text_only"] = True``
  (SDPO's loss never reads the reward; the REINFORCE++ statistics of the job skip such entries);
* feedback text with a reward >= 1 (a passing turn): used only with ``claas.sdpo.reprompt_success`` (the success
  template), as for a passing scenario step; else the turn has no teacher context and the feedback response says so;
* no feedback text: no teacher context (sd_mask = 0).
"""

from __future__ import annotations

from typing import Any

from claas_verl.claas.service.templating import render_prompt_ids

TEACHER_IDS_KEY = "teacher_prompt_ids"  # the entry metadata key the scenario producers use too
TEXT_ONLY_KEY = "text_only"  # metadata mark of an entry whose feedback came without a reward


class SdpoTeacherContext:
    """Builds the teacher context x' of a chat turn from its messages and the feedback text.

    Args:
        tokenizer: the policy tokenizer (its chat template renders x' exactly as the turn's own prompt was rendered).
        reprompt_success: ``claas.sdpo.reprompt_success``: also re-prompt turns with reward >= 1.
    """

    def __init__(self, tokenizer: Any, *, reprompt_success: bool = False):
        self.tokenizer = tokenizer
        self.reprompt_success = bool(reprompt_success)

    def unused_reason(self, feedback: str | None, reward: float | None) -> str | None:
        """Why the feedback of a turn gives no SDPO signal (None: it does); text for the feedback response."""
        if not feedback:
            return "no feedback text: this turn trains with no SDPO signal (sd_mask = 0)"
        if reward is not None and reward >= 1.0 and not self.reprompt_success:
            return ("feedback text not used: reward >= 1 marks a passing turn, whose feedback SDPO uses only with "
                    "claas.sdpo.reprompt_success=true; send reward null or < 1 with a correction")
        return None

    def prompt_ids(self, messages: list[dict], feedback: str | None, reward: float | None,
                   chat_template_kwargs: dict | None = None) -> list[int] | None:
        """Token ids of x' (the turn's messages with the last user message re-prompted), or None when the turn gets no
        SDPO signal (:meth:`unused_reason`). Blocking (Jinja, the tokenizer): call it off the event loop."""
        from claas_verl.losses.sdpo import teacher_messages

        if self.unused_reason(feedback, reward) is not None:
            return None
        teacher = teacher_messages(messages, feedback, reward=reward, reprompt_success=self.reprompt_success)
        return None if teacher is None else render_prompt_ids(self.tokenizer, teacher, chat_template_kwargs)
