"""What happens to a served turn until the replay buffer holds it: recorded (or why not), held for feedback or
graded, checked against the key's buffer share, submitted, acknowledged; every outcome counted per key.

:class:`TurnLedger` is the chat service's bookkeeping of turns, apart from serving them
(:class:`~claas_verl.claas.service.app.ChatService`) and from HTTP (:mod:`~claas_verl.claas.service.http_app`).
"""

import asyncio
from typing import Any

import numpy as np

from claas_verl.claas.service.backend import MIXED_VERSION, Generation
from claas_verl.claas.service.buffer_share import BufferShare
from claas_verl.claas.service.config import ServiceConfig
from claas_verl.claas.service.errors import LimitError, Unavailable
from claas_verl.claas.service.grading import Grader, GradeRequest, normalize_grade
from claas_verl.claas.service.guard import validate_reward
from claas_verl.claas.service.recorder import TrajectoryRecorder, TurnRecord, behaviour_logprob, unrecordable_reason
from claas_verl.claas.service.sampling import SamplingParams, training_violations, violation_message
from claas_verl.claas.service.sinks import make_sink
from claas_verl.claas.service.teacher import TEACHER_IDS_KEY, TEXT_ONLY_KEY, SdpoTeacherContext

#: Retry-After of feedback refused for the buffer share: room comes from other keys' entries or the next policy
#: update, neither of which the service can time
SHARE_RETRY_S = 5.0


class TurnLedger:
    """Turns between their response and the replay buffer (thread-safe counters; coroutines on the service's loop).

    Args:
        sink: a ``ReplayBuffer``, a ``ReplayBufferActor`` handle or a sink object (see ``make_sink``).
        config: the service's :class:`~claas_verl.claas.service.config.ServiceConfig` (pending bounds, grading, share).
        grader: optional reward callback; without one, turns wait for ``POST /v1/feedback``.
        teacher: SDPO only (:class:`~claas_verl.claas.service.teacher.SdpoTeacherContext`): each turn keeps its
            messages until its feedback, and feedback text becomes the entry's teacher context; feedback text with
            reward null is then an entry too (text-only feedback, see :mod:`~claas_verl.claas.service.teacher`).
        tenant: a multi-tenant service's ledger of one tenant (its sink writes that tenant's replay partition only;
            ``config`` carries the tenant's quotas); None: the single-tenant service.
    """

    def __init__(self, sink: Any, config: ServiceConfig, grader: Grader | None = None,
                 teacher: SdpoTeacherContext | None = None, tenant: str | None = None):
        self.config = config
        self.tenant = tenant  # a multi-tenant service's ledger of one tenant: its turns, pending table and partition
        self.grader = grader
        self.teacher = teacher
        self.recorder = TrajectoryRecorder(make_sink(sink, tenant), max_pending=config.max_pending,
                                           pending_ttl_s=config.pending_ttl_s,
                                           max_pending_per_key=config.max_pending_per_key,
                                           max_pending_bytes=config.max_pending_bytes)
        self.buffer_share = BufferShare(config.max_buffer_share)
        if self.buffer_share.enabled and not hasattr(self.recorder.sink, "fill"):
            raise ValueError(f"max_buffer_share={config.max_buffer_share} needs a sink that reports the buffer's "
                             f"fill (fill() -> (size, b_max)); {type(self.recorder.sink).__name__} has none: set "
                             "max_buffer_share=1.0 or use a ReplayBuffer / replay actor sink")
        self._tasks: set[asyncio.Task] = set()  # background gradings

    def grading_full(self) -> bool:
        """Whether the background grading queue is at ``max_grading`` (a recorded chat is then refused: 429)."""
        return self.grader is not None and not self.config.grade_inline and len(self._tasks) >= self.config.max_grading

    @property
    def grading(self) -> int:
        return len(self._tasks)

    async def record(self, request_id: str, gen: Generation, params: SamplingParams, messages: list[dict],
                     ctx: dict) -> tuple[str, str | None]:
        """Record a served turn: ``(status, reason)`` for the response's ``claas`` object (``pending_feedback``,
        ``grading``, the grader's outcome when grading inline, or why it was not recorded; each counted)."""
        owner = ctx["owner"]
        if not ctx["record"]:
            self.recorder.count("not_recorded", owner=owner)
            return "not_recorded", "recording is off for this request"
        violations = training_violations(params)
        if violations:
            self.recorder.count("rejected_sampling", owner=owner)
            return "rejected", violation_message(violations)
        scenario_id = ctx["scenario_id"] if ctx["scenario_id"] is not None else self.config.default_scenario_id
        if gen.finish_reason == MIXED_VERSION:
            self.recorder.count("dropped_mixed_version", owner=owner)
            return "dropped", "not recorded: the response's tokens came from more than one policy version"
        if gen.finish_reason not in ("stop", "length"):
            # aborted (e.g. by a weight update) or truncated by the server for any other reason: the sampled tokens
            # are not a complete draw from one policy, never an entry (counted)
            self.recorder.count("dropped_aborted", owner=owner)
            return "dropped", f"not recorded: the generation ended with finish_reason={gen.finish_reason!r}"
        why = unrecordable_reason(gen)
        if why is None and scenario_id is None:
            why = "no scenario id (send metadata.scenario_id or the X-Claas-Scenario-Id header)"
        if why is not None:
            self.recorder.count("rejected_unrecordable", owner=owner)
            return "rejected", f"not recorded: {why}"
        metadata = {"request_id": request_id, "model": gen.model, "finish_reason": gen.finish_reason}
        if self.tenant is not None:
            metadata["tenant"] = self.tenant  # the partition it is written to says so too; the entry carries it
        if ctx["scenario_key"] is not None:
            metadata["scenario"] = ctx["scenario_key"]
        if ctx["client_metadata"]:
            metadata["client"] = ctx["client_metadata"]
        graded = self.grader is not None
        keep_texts = graded or self.teacher is not None  # the grader's input / the SDPO teacher context's
        record = TurnRecord(
            request_id=request_id, scenario_id=scenario_id, step_idx=ctx["step_idx"],
            prompt_ids=np.asarray(gen.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(gen.response_ids, dtype=np.int32),
            behaviour_logprob=behaviour_logprob(gen.token_logprobs), policy_version=gen.policy_version,
            domain=ctx["domain"], metadata=metadata, owner=owner,
            # the texts are the grader's input, and SDPO's teacher context is built from the messages; otherwise a
            # turn waiting for feedback keeps its tokens, not its texts
            messages=messages if keep_texts else [], text=gen.text if graded else "",
            template_kwargs=ctx.get("template_kwargs") if self.teacher is not None else None,
        )
        if not graded:
            if not self.recorder.hold(record):
                return "dropped", (f"not recorded: the turn alone exceeds the pending byte budget "
                                   f"({self.config.max_pending_bytes} bytes)")
            return "pending_feedback", None
        self.recorder.count("graded", owner=owner)
        if self.config.grade_inline:
            return await self._grade_and_finish(record, raise_unavailable=True)
        task = asyncio.get_running_loop().create_task(self._grade_and_finish(record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return "grading", None

    async def _grade_and_finish(self, record: TurnRecord, raise_unavailable: bool = False) -> tuple[str, str | None]:
        request = GradeRequest(messages=record.messages, response_text=record.text, scenario_id=record.scenario_id,
                               step_idx=record.step_idx, metadata=dict(record.metadata))
        try:
            reward, feedback = normalize_grade(await asyncio.to_thread(self.grader, request))
        except Exception as exc:  # any grader failure is a grader error: reward None (docs/math.md §A.1.4)
            self.recorder.count("dropped_grader_error", owner=record.owner)
            return "dropped", f"grader error ({exc!r}): never used for training (docs/math.md §A.1.4)"
        reserved = reward is not None and self.buffer_share.enabled  # a grader's reward None is a grader error
        if reserved and await self._share_refused(record.owner):
            # a graded turn has no client to retry it: dropped, counted
            self.recorder.count("dropped_buffer_share", owner=record.owner)
            return "dropped", self._share_message()
        try:
            return await self._settle(record, reward, feedback, reserved=reserved)
        except Unavailable as exc:
            if raise_unavailable:
                raise
            return "dropped", str(exc)

    async def _share_refused(self, owner: str) -> bool:
        """Reserve a buffer write for ``owner`` under its buffer share (which must be enabled); True (nothing
        reserved) when refused. The buffer's fill is asked (off the event loop) only when the key is at its share."""
        share = self.buffer_share
        if not share.needs_fill(owner):
            return not share.reserve(owner)
        try:
            size, capacity = await asyncio.to_thread(self.recorder.sink.fill)
        except Exception as exc:  # noqa: BLE001 - a buffer that does not answer cannot take the entry either
            raise Unavailable(f"the replay buffer does not answer ({exc!r}); retry later", 5.0) from None
        return not share.reserve(owner, size, capacity)

    def _share_message(self) -> str:
        share = self.buffer_share
        return (f"this API key holds its share of the replay buffer ({share.limit(share.capacity or 1)} of "
                f"{share.capacity} entries, max_buffer_share={share.share:g}, set by claas.service.max_buffer_share); "
                "the buffer is full and this entry would push out another key's: retry once other keys' entries or "
                "policy updates have made room")

    async def _settle(self, record: TurnRecord, reward: float | None, feedback: str | None,
                      reserved: bool = False, text_only: bool = False) -> tuple[str, str | None]:
        """Submit ``record`` with its reward and wait for the buffer: ``("accepted", None)`` once it is in the
        buffer, ``("refused", why)`` when the buffer refused it, ``Unavailable`` when the write failed or was not
        acknowledged within ``ack_timeout_s`` (each counted). ``reserved``: a buffer-share reservation of the owner
        to end with the outcome. ``text_only``: SDPO feedback text with reward null (stored with reward 0, marked).
        With SDPO an accepted turn whose feedback gives no teacher context says why in ``reason``."""
        status = None
        try:
            metadata, note = None, None
            if self.teacher is not None and (reward is not None or text_only):
                metadata, note = await self._teacher_metadata(record, reward, feedback, text_only)
                if text_only:
                    reward = 0.0
            status, reason = await self._submit(record, reward, feedback, metadata)
            return status, reason if status != "accepted" else note
        finally:
            if reserved:
                self.buffer_share.release(record.owner, accepted=status == "accepted")

    async def _teacher_metadata(self, record: TurnRecord, reward: float | None, feedback: str | None,
                                text_only: bool) -> tuple[dict, str | None]:
        """The SDPO entry metadata of ``record`` (teacher context ids, text-only mark) and why its feedback gives no
        signal (None: it does). Rendering blocks (Jinja): off the event loop."""
        ids = await asyncio.to_thread(self.teacher.prompt_ids, record.messages, feedback,
                                      None if text_only else reward, record.template_kwargs)
        metadata = {TEACHER_IDS_KEY: ids} if ids is not None else {}
        if text_only:
            metadata[TEXT_ONLY_KEY] = True
        return metadata, None if ids is not None else self.teacher.unused_reason(feedback, reward)

    async def _submit(self, record: TurnRecord, reward: float | None, feedback: str | None,
                      metadata: dict | None = None) -> tuple[str, str | None]:
        status, reason, ack = self.recorder.finish(record, reward, feedback, metadata)
        if ack is None:
            return status, reason
        try:
            accepted = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(ack)), self.config.ack_timeout_s)
        except asyncio.TimeoutError:
            self.recorder.count("dropped_unconfirmed", owner=record.owner)
            raise Unavailable(f"the replay buffer did not acknowledge the entry within {self.config.ack_timeout_s:g}s;"
                              " it may or may not have been stored", 5.0) from None
        except Exception as exc:  # noqa: BLE001 - the actor died or the write failed: the client must know
            self.recorder.count("dropped_buffer_error", owner=record.owner)
            raise Unavailable(f"the replay buffer did not take the entry ({exc}); the feedback was not stored",
                              5.0) from None
        if accepted >= 1:
            self.recorder.count("accepted", owner=record.owner)
            return "accepted", None
        self.recorder.count("dropped_buffer_refused", owner=record.owner)
        return "refused", "the replay buffer refused the entry (a duplicate request id, or stale on arrival)"


    async def feedback(self, body: dict, owner: str) -> dict:
        """``POST /v1/feedback`` for ``owner``: validate, check the buffer share (429 leaves the turn pending), take
        the turn and settle it (status ``unknown``: no such pending turn of this key)."""
        if not isinstance(body, dict):
            raise ValueError("the feedback body must be a JSON object")
        request_id = body.get("request_id", body.get("id"))
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("'request_id' must be the 'id' of a chat completion response")
        if "reward" not in body:
            raise ValueError("'reward' is required: 0 or 1 (or in [0, 1] if the recipe says so), or null for a "
                             "grader error (the turn is dropped)")
        reward = validate_reward(body["reward"], self.config.reward)
        text = body.get("feedback")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"'feedback' must be a string or null, got {type(text).__name__}")
        if text is not None and len(text) > self.config.max_message_chars:
            raise LimitError(f"'feedback' has {len(text)} characters; at most {self.config.max_message_chars}")
        # SDPO: feedback text without a reward is still an entry (its teacher context is the signal); without SDPO, or
        # without text, reward null drops the turn (docs/math.md §A.1.4)
        text_only = reward is None and bool(text) and self.teacher is not None
        reserved = False
        if (reward is not None or text_only) and self.buffer_share.enabled and self.recorder.owns(request_id, owner):
            if await self._share_refused(owner):  # refused before the turn is taken: it stays pending for a retry
                self.recorder.count("rejected_buffer_share", owner=owner)
                raise LimitError(self._share_message(), 429, SHARE_RETRY_S)
            reserved = True
        record = self.recorder.take(request_id, owner)
        if record is None:
            if reserved:
                self.buffer_share.release(owner, accepted=False)
            return {"request_id": request_id, "status": "unknown", "reason": self.recorder.unknown_reason(request_id)}
        status, reason = await self._settle(record, reward, text, reserved=reserved, text_only=text_only)
        return {"request_id": request_id, "status": status, "reason": reason}

    def share_stats(self) -> dict:
        """``max`` (the configured fraction), ``limit`` (entries per key, once the capacity is known) and ``held``
        (per key: entries of the last ``b_max`` it wrote, an upper bound of what it holds in the buffer)."""
        share = self.buffer_share
        return {"max": share.share, "limit": share.limit(share.capacity) if share.capacity else None,
                "held": share.held()}

    async def drain(self, timeout_s: float) -> None:
        """Wait for background gradings (those still running after ``timeout_s`` are cancelled and counted
        ``dropped_shutdown``), then for the sink's writes in flight; drop (counted ``dropped_shutdown``) the turns
        still waiting for feedback, which can get none any more."""
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=timeout_s)
            for task in late:
                task.cancel()
            if late:
                self.recorder.count("dropped_shutdown", len(late))
        await asyncio.to_thread(self.recorder.sink.flush, timeout_s)
        self.recorder.drop_all("dropped_shutdown")
