"""The CLaaS chat service: an OpenAI-compatible chat API that records every assistant turn for training.

Agents point their OpenAI client at this service instead of at vLLM (001: "connects to any agent harness with a
single line of code"). Each response is served as usual and, when recordable, becomes a replay entry once its reward
is known (grader callback or ``POST /v1/feedback``). The trainer hot-reloads new LoRA versions through
:meth:`ChatService.load_adapter` (in process) or ``POST /v1/claas/load_adapter`` (over HTTP).

Endpoints::

    GET  /health                    {"status": "ok", "policy_version", "model"}
    GET  /v1/models                 OpenAI model list (base + served adapter)
    POST /v1/chat/completions       OpenAI chat completion + a "claas" object (request id, version, record status)
    POST /v1/feedback               {"request_id", "reward": float|null, "feedback": str|null}
    POST /v1/claas/load_adapter     {"lora_path", "policy_version"?}  (trainer -> service hot-reload)
    GET  /v1/claas/stats            recorder and sink counters

Request metadata (body ``metadata`` object, or headers; the body wins): ``scenario_id`` / ``X-Claas-Scenario-Id``
(int >= 0, or any string, mapped to a stable int and kept in the entry's metadata), ``step_idx`` /
``X-Claas-Step-Idx``, ``domain`` / ``X-Claas-Domain``, ``record`` / ``X-Claas-Record`` (false/0 opts out).
"""

import asyncio
import contextlib
import dataclasses
import hmac
import json
import math
import os
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from claas_verl.service.backend import BackendError, ChatBackend, Generation
from claas_verl.service.grading import Grader, GradeRequest, normalize_grade
from claas_verl.service.lora_reload import LoRAReloadError
from claas_verl.service.recorder import COUNTERS, TrajectoryRecorder, TurnRecord, behaviour_logprob, unrecordable_reason
from claas_verl.service.sampling import SamplingParams, training_violations, violation_message
from claas_verl.service.sinks import make_sink
from claas_verl.service.streaming import StreamStart, TokenDelta
from claas_verl.service.templating import normalize_messages

_FALSE = {"0", "false", "no", "off"}


REWARD_MODES = ("binary", "unit")


class AuthError(PermissionError):
    """A missing or wrong API key (HTTP 401) or a missing admin right (HTTP 403)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LimitError(ValueError):
    """A request over a size limit (HTTP 413 for the body, 400 otherwise); the message names the limit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServiceConfig:
    """Service settings.

    Fields:
        record: record turns at all (False: a plain proxy).
        default_scenario_id: scenario id of requests that give none; ``None`` makes such requests unrecordable.
        max_pending / pending_ttl_s: bound and timeout of the table of turns awaiting feedback (expiry and overflow
            drops are counted in the stats).
        grade_inline: with a grader, grade before answering (the response then carries the final status); by
            default grading runs after the response is sent, off the chat latency.
        sweep_interval_s: how often expired pending turns are dropped in the background.
        api_keys: accepted ``Authorization: Bearer`` keys for every endpoint except ``/health``; empty: no auth
            (only allowed on a loopback host, see :func:`check_exposure`).
        admin_key: key of the admin endpoints (adapter load, shutdown); ``None`` disables them.
        adapter_root: the only directory ``POST /v1/claas/load_adapter`` loads from (a run's own output
            directory); ``None`` refuses every load over HTTP.
        reward: ``"binary"`` (rewards in {0, 1}) or ``"unit"`` (any value in [0, 1]); SPEC A.1.4 rewards.
        max_body_bytes / max_messages / max_message_chars: request limits (413 / 400 / 400).
        max_tokens: the largest ``max_tokens`` a request may ask for (``None``: the backend's bound only);
            requests without ``max_tokens`` get ``default_max_tokens`` (or the backend's default).
    """

    record: bool = True
    default_scenario_id: int | None = 0
    max_pending: int = 4096
    pending_ttl_s: float = 600.0
    grade_inline: bool = False
    sweep_interval_s: float = 5.0
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    adapter_root: str | None = None
    reward: str = "binary"
    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_message_chars: int = 32_768
    max_tokens: int | None = None
    default_max_tokens: int | None = None

    def __post_init__(self):
        if self.default_scenario_id is not None and (not isinstance(self.default_scenario_id, int)
                                                     or self.default_scenario_id < 0):
            raise ValueError(f"default_scenario_id must be None or an int >= 0, got {self.default_scenario_id!r}")
        if not self.sweep_interval_s > 0:
            raise ValueError(f"sweep_interval_s must be > 0, got {self.sweep_interval_s}")
        if self.reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {REWARD_MODES}, got {self.reward!r}")
        keys = tuple(self.api_keys or ())
        if any(not isinstance(k, str) or not k for k in keys):
            raise ValueError("api_keys must be non-empty strings")
        object.__setattr__(self, "api_keys", keys)
        if self.admin_key is not None and (not isinstance(self.admin_key, str) or not self.admin_key):
            raise ValueError("admin_key must be a non-empty string or None")
        for name in ("max_body_bytes", "max_messages", "max_message_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("max_tokens", "default_max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.max_tokens is not None and self.default_max_tokens is not None \
                and self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds max_tokens={self.max_tokens}")


def check_exposure(host: str, config: ServiceConfig) -> None:
    """Refuse to serve without API keys on anything but a loopback address (anyone could feed the trainer)."""
    if config.api_keys or host in ("127.0.0.1", "localhost", "::1"):
        return
    raise ValueError(f"the chat service would listen on {host!r} without API keys; set claas.service.api_keys "
                     "(or the environment variable CLAAS_API_KEY), or listen on 127.0.0.1")


def validate_reward(value: Any, mode: str) -> float | None:
    """The ``reward`` field of ``POST /v1/feedback`` (SPEC A.1.4): ``None`` (grader error: dropped), else a number in
    {0, 1} (``mode="binary"``) or [0, 1] (``mode="unit"``); ``ValueError`` naming the field otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"'reward' must be a finite number (or null for a grader error), got {value!r}")
    if mode == "binary" and value not in (0, 1):
        raise ValueError(f"'reward' must be 0 or 1 (this run uses binary rewards, SPEC A.1.4), got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"'reward' must be in [0, 1] (SPEC A.1.4), got {value!r}")
    return float(value)


def scenario_key_to_id(key: Any) -> tuple[int, str | None]:
    """``(scenario_id, original_key)``: an int >= 0 (or its decimal string) is used as is; any other string maps to
    a stable 31-bit id (crc32) and is returned so the entry keeps it in ``metadata["scenario"]``."""
    if isinstance(key, bool):
        raise ValueError(f"scenario_id must be an int >= 0 or a string, got {key!r}")
    if isinstance(key, int):
        if key < 0:
            raise ValueError(f"scenario_id must be >= 0, got {key}")
        return key, None
    if isinstance(key, str) and key:
        if key.isdigit():
            return int(key), None
        return zlib.crc32(key.encode()) & 0x7FFFFFFF, key
    raise ValueError(f"scenario_id must be an int >= 0 or a non-empty string, got {key!r}")


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() not in _FALSE


class ChatService:
    """Chat handling, recording and hot-reload, independent of the HTTP layer (``build_app`` wraps it).

    Args:
        backend: a :class:`~claas_verl.service.backend.ChatBackend`.
        sink: a ``ReplayBuffer``, a ``ReplayBufferActor`` handle or a sink object (see ``make_sink``).
        grader: optional reward callback (see :mod:`claas_verl.service.grading`); without one, rewards come from
            ``POST /v1/feedback``.
        config: :class:`ServiceConfig`.
    """

    def __init__(self, backend: ChatBackend, sink: Any, grader: Grader | None = None,
                 config: ServiceConfig | None = None, extra_stats: Callable[[], dict] | None = None,
                 on_shutdown: Callable[[], None] | None = None):
        self.backend = backend
        self.config = config or ServiceConfig()
        self.grader = grader
        self.recorder = TrajectoryRecorder(make_sink(sink), max_pending=self.config.max_pending,
                                           pending_ttl_s=self.config.pending_ttl_s)
        self._tasks: set[asyncio.Task] = set()
        self.reloads = 0
        self.extra_stats = extra_stats
        self.on_shutdown = on_shutdown
        self.shutdown_requested = threading.Event()

    # ------------------------------------------------------------------ auth
    def authorize(self, headers: Mapping[str, str], admin: bool = False) -> None:
        """``AuthError`` unless ``headers`` carry an accepted ``Authorization: Bearer`` key (the admin key for
        admin endpoints). Keys are compared in constant time."""
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if admin:
            if self.config.admin_key is None:
                raise AuthError(403, "admin endpoints are disabled: start the service with an admin key "
                                     "(claas.service.admin_key or CLAAS_ADMIN_KEY)")
            if not token or not hmac.compare_digest(token.encode(), self.config.admin_key.encode()):
                raise AuthError(401, "this endpoint needs the admin key: Authorization: Bearer <admin key>")
            return
        if not self.config.api_keys:
            return
        ok = any(hmac.compare_digest(token.encode(), k.encode()) for k in self.config.api_keys) if token else False
        if not ok and self.config.admin_key is not None and token:
            ok = hmac.compare_digest(token.encode(), self.config.admin_key.encode())
        if not ok:
            raise AuthError(401, "missing or wrong API key: send Authorization: Bearer <key> "
                                 "(OpenAI(api_key=...) does this)")

    # ------------------------------------------------------------------ chat
    def _context(self, body: dict, headers: Mapping[str, str]) -> dict:
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise ValueError("'metadata' must be an object")
        h = {k.lower(): v for k, v in headers.items()}

        def pick(key: str, header: str):
            return meta[key] if key in meta else h.get(header)

        ctx: dict[str, Any] = {"record": self.config.record, "client_metadata": {}}
        record = pick("record", "x-claas-record")
        if record is not None:
            ctx["record"] = ctx["record"] and _flag(record)
        key = pick("scenario_id", "x-claas-scenario-id")
        ctx["scenario_id"], ctx["scenario_key"] = (None, None) if key is None else scenario_key_to_id(key)
        step = pick("step_idx", "x-claas-step-idx")
        if step is not None:
            try:
                step = int(step)
            except (TypeError, ValueError):
                raise ValueError(f"step_idx must be an int >= 0, got {step!r}") from None
            if step < 0:
                raise ValueError(f"step_idx must be an int >= 0, got {step}")
        ctx["step_idx"] = step
        domain = pick("domain", "x-claas-domain")
        ctx["domain"] = None if domain is None else str(domain)
        ctx["client_metadata"] = {k: v for k, v in meta.items()
                                  if k not in ("record", "scenario_id", "step_idx", "domain")}
        return ctx

    def _limit(self, body: dict, params: SamplingParams) -> SamplingParams:
        cfg = self.config
        msgs = body.get("messages")
        if isinstance(msgs, list) and len(msgs) > cfg.max_messages:
            raise LimitError(f"'messages' has {len(msgs)} messages; this service accepts at most {cfg.max_messages}")
        if params.max_tokens is not None and cfg.max_tokens is not None and params.max_tokens > cfg.max_tokens:
            raise LimitError(f"'max_tokens'={params.max_tokens} exceeds this service's limit of {cfg.max_tokens} "
                             "(set by the recipe: claas.service.max_tokens)")
        if params.max_tokens is None and cfg.default_max_tokens is not None:
            params = dataclasses.replace(params, max_tokens=cfg.default_max_tokens)
        return params

    def _check_message_sizes(self, messages: list[dict]) -> None:
        for i, m in enumerate(messages):
            if len(m["content"]) > self.config.max_message_chars:
                raise LimitError(f"messages[{i}].content has {len(m['content'])} characters; this service accepts "
                                 f"at most {self.config.max_message_chars} per message")

    def _prepare(self, body: dict, headers: Mapping[str, str] | None) -> tuple[SamplingParams, list[dict], dict,
                                                                              dict | None]:
        """Validate a chat request: ``(params, messages, ctx, chat_template_kwargs)``; errors name the field."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        params = self._limit(body, SamplingParams.from_request(body))
        messages = normalize_messages(body.get("messages"))
        self._check_message_sizes(messages)
        ctx = self._context(body, headers or {})
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("'chat_template_kwargs' must be an object")
        return params, messages, ctx, kwargs

    async def chat(self, body: dict, headers: Mapping[str, str] | None = None) -> dict:
        """Serve one chat completion and record it; returns the OpenAI response dict with a ``claas`` object."""
        params, messages, ctx, kwargs = self._prepare(body, headers)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await self.backend.generate(messages, params, kwargs)
        self.recorder.count("served")
        status, reason = await self._record(request_id, gen, params, messages, ctx)
        return self._response(request_id, gen, params, status, reason, ctx)

    async def chat_stream(self, body: dict, headers: Mapping[str, str] | None = None) -> AsyncIterator[str]:
        """Serve one chat completion as OpenAI's server-sent events, token by token as the backend samples them.

        Returns once the request runs on the backend (so a refused request is still an HTTP error, not an event),
        with an async iterator of ``data: {chunk}`` lines: a role chunk, one chunk per content delta, a final chunk
        with ``finish_reason`` and ``usage``, then ``data: [DONE]``. Every chunk carries ``claas`` with the
        ``request_id`` and the ``policy_version`` serving the request; the final chunk carries the full ``claas``
        object of a non-streamed reply (record status, reason, token count, behaviour log-prob).

        The turn is recorded from the backend's final :class:`Generation` (the sampled ids and log-probs, never the
        streamed text), exactly like a non-streamed turn. A client that goes away before the final chunk reached it
        (the iterator is closed early) stops the generation; the turn is dropped and counted as ``disconnected``
        (a turn already waiting for feedback is withdrawn from the pending table). A backend failure after the
        first chunk ends the stream with an OpenAI error event, counted as ``stream_error``.
        """
        params, messages, ctx, kwargs = self._prepare(body, headers)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        events = self.backend.stream(messages, params, kwargs)
        try:
            start = await anext(events)
        except StopAsyncIteration:
            raise BackendError("the backend's stream ended before the request started") from None
        except BaseException:
            await events.aclose()
            raise
        if not isinstance(start, StreamStart):
            await events.aclose()
            raise BackendError(f"the backend's stream must start with a StreamStart, got {type(start).__name__}")
        return self._sse(request_id, start, events, params, messages, ctx)

    async def _sse(self, request_id: str, start: StreamStart, events: AsyncIterator, params: SamplingParams,
                   messages: list[dict], ctx: dict) -> AsyncIterator[str]:
        import anyio  # starlette's dependency (the HTTP layer); its cancel scopes are what cancel a response

        created = int(time.time())
        head = {"request_id": request_id, "policy_version": start.policy_version, "scenario_id": ctx["scenario_id"],
                "step_idx": ctx["step_idx"]}

        def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None, claas: dict = head,
                  **extra) -> str:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": start.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
                    "claas": claas, **extra}
            return f"data: {json.dumps(body)}\n\n"

        delivered = False  # the final chunk reached the client
        outcome = None  # the record status, once the generation is complete
        try:
            yield chunk({"role": "assistant", "content": ""})
            gen = None
            async for event in events:
                if isinstance(event, Generation):
                    gen = event
                    break
                if not isinstance(event, TokenDelta):
                    raise BackendError(f"unexpected stream event {type(event).__name__}")
                logprobs = None
                if params.logprobs and event.logprobs is not None and event.token_ids:
                    logprobs = {"content": _logprob_items(event.token_ids, event.logprobs)}
                if event.text or logprobs is not None:
                    yield chunk({"content": event.text}, logprobs=logprobs)
            if gen is None:
                raise BackendError("the backend's stream ended without the complete response")
            self.recorder.count("served")
            status, reason = await self._record(request_id, gen, params, messages, ctx)
            outcome = status
            response = self._response(request_id, gen, params, status, reason, ctx)
            yield chunk({}, gen.finish_reason, claas=response["claas"], usage=response["usage"])
            delivered = True
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - a disconnect is a BaseException (CancelledError/GeneratorExit)
            # after the 200 and the first chunk, an error can only be an event (the openai client raises APIError)
            self.recorder.count("dropped_stream_error")
            delivered = True
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'backend_error', 'code': 502}})}\n\n"
        finally:
            if not delivered:
                # The client went away (or the server is stopping) before the reply was complete on its side: a
                # generation still running is stopped and never recorded; a complete turn waiting for feedback is
                # withdrawn (no feedback can come for a reply the client did not get). A turn handed to a grader
                # or already settled keeps its outcome: the grader needs no client.
                if outcome is None or (outcome == "pending_feedback" and self.recorder.withdraw(request_id)):
                    self.recorder.count("dropped_disconnected")
            # shielded: a response cancelled by its disconnect must still close the backend stream
            with anyio.CancelScope(shield=True):
                await events.aclose()

    async def _record(self, request_id, gen, params, messages, ctx) -> tuple[str, str | None]:
        if not ctx["record"]:
            self.recorder.count("not_recorded")
            return "not_recorded", "recording is off for this request"
        violations = training_violations(params)
        if violations:
            self.recorder.count("rejected_sampling")
            return "rejected", violation_message(violations)
        scenario_id = ctx["scenario_id"] if ctx["scenario_id"] is not None else self.config.default_scenario_id
        if gen.finish_reason not in ("stop", "length"):
            # aborted (e.g. by a weight update) or truncated by the server for any other reason: the sampled tokens
            # are not a complete draw from one policy, never an entry (counted)
            self.recorder.count("dropped_aborted")
            return "dropped", f"not recorded: the generation ended with finish_reason={gen.finish_reason!r}"
        why = unrecordable_reason(gen)
        if why is None and scenario_id is None:
            why = "no scenario id (send metadata.scenario_id or the X-Claas-Scenario-Id header)"
        if why is not None:
            self.recorder.count("rejected_unrecordable")
            return "rejected", f"not recorded: {why}"
        metadata = {"request_id": request_id, "model": gen.model, "finish_reason": gen.finish_reason}
        if ctx["scenario_key"] is not None:
            metadata["scenario"] = ctx["scenario_key"]
        if ctx["client_metadata"]:
            metadata["client"] = ctx["client_metadata"]
        record = TurnRecord(
            request_id=request_id, scenario_id=scenario_id, step_idx=ctx["step_idx"], prompt_ids=gen.prompt_ids,
            response_ids=gen.response_ids, behaviour_logprob=behaviour_logprob(gen.token_logprobs),
            policy_version=gen.policy_version, domain=ctx["domain"], metadata=metadata, messages=messages,
            text=gen.text,
        )
        if self.grader is None:
            self.recorder.hold(record)
            return "pending_feedback", None
        self.recorder.count("graded")
        if self.config.grade_inline:
            return await self._grade_and_finish(record)
        task = asyncio.get_running_loop().create_task(self._grade_and_finish(record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return "grading", None

    async def _grade_and_finish(self, record: TurnRecord) -> tuple[str, str | None]:
        request = GradeRequest(messages=record.messages, response_text=record.text, scenario_id=record.scenario_id,
                               step_idx=record.step_idx, metadata=dict(record.metadata))
        try:
            reward, feedback = normalize_grade(await asyncio.to_thread(self.grader, request))
        except Exception as exc:  # any grader failure is a grader error: reward None (SPEC A.1.4)
            self.recorder.count("dropped_grader_error")
            return "dropped", f"grader error ({exc!r}): never used for training (SPEC A.1.4)"
        return self.recorder.finish(record, reward, feedback)

    def _response(self, request_id, gen, params, status, reason, ctx) -> dict:
        n_prompt = len(gen.prompt_ids) if gen.prompt_ids is not None else 0
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": gen.text},
            "finish_reason": gen.finish_reason,
            "logprobs": None,
        }
        if params.logprobs and gen.token_logprobs is not None:
            choice["logprobs"] = {"content": _logprob_items(gen.response_ids, gen.token_logprobs)}
        lp = gen.token_logprobs
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": gen.model,
            "choices": [choice],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(gen.response_ids),
                      "total_tokens": n_prompt + len(gen.response_ids)},
            "claas": {
                "request_id": request_id,
                "policy_version": gen.policy_version,
                "record": status,
                "reason": reason,
                "scenario_id": ctx["scenario_id"],
                "step_idx": ctx["step_idx"],
                "n_tokens": len(gen.response_ids),
                "behaviour_logprob": behaviour_logprob(lp) if lp and len(lp) == len(gen.response_ids) else None,
            },
        }

    # ------------------------------------------------------------------ feedback, reload, stats
    def feedback(self, body: dict) -> dict:
        """``POST /v1/feedback``: reward (and feedback text) for a pending turn."""
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
        status, reason = self.recorder.feedback(request_id, reward, text)
        return {"request_id": request_id, "status": status, "reason": reason}

    def adapter_path(self, path: str) -> str:
        """``path`` resolved (symlinks included) if it lies inside ``config.adapter_root``; ``AuthError`` 403 else."""
        root = self.config.adapter_root
        if root is None:
            raise AuthError(403, "adapter loads over HTTP are disabled (no adapter_root: a training job publishes "
                                 "its own adapters)")
        real, real_root = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            raise AuthError(403, f"'lora_path' must lie inside the run's output directory {real_root}")
        return real

    async def load_adapter(self, path: str, version: int | None = None) -> dict:
        """Serve the LoRA adapter at ``path`` as ``version`` (default current + 1); in-flight requests keep theirs."""
        new = await self.backend.load_adapter(path, version)
        self.reloads += 1
        return {"policy_version": new, "model": self.backend.served_model}

    def load_adapter_sync(self, path: str, version: int | None = None) -> dict:
        """:meth:`load_adapter` from a thread with no running event loop (e.g. a trainer's update thread)."""
        return asyncio.run(self.load_adapter(path, version))

    def stats(self) -> dict:
        """Recorder counters, a ``turns`` summary (recorded, pending, completed, expired, dropped by reason), the
        served version, and whatever ``extra_stats`` adds (the training job: buffer statistics and updates)."""
        rec = self.recorder.stats()
        sink = rec.get("sink", {})
        dropped = {name[len("dropped_"):]: rec[name] for name in COUNTERS if name.startswith("dropped_")}
        dropped.update({name: rec[name] for name in ("rejected_sampling", "rejected_unrecordable",
                                                     "rejected_invalid")})
        dropped["buffer_refused"] = int(sink.get("submitted", 0)) - int(sink.get("accepted", 0)) \
            - int(sink.get("in_flight", 0))
        out = {**rec, "policy_version": self.backend.policy_version, "model": self.backend.served_model,
               "reloads": self.reloads,
               "turns": {"served": rec["served"], "recorded": rec["pending"] + rec["graded"],
                         "pending": rec["pending_now"], "completed": rec["submitted"],
                         "accepted": int(sink.get("accepted", 0)), "expired": rec["dropped_timeout"],
                         "dropped": dropped}}
        if self.extra_stats is not None:
            out.update(self.extra_stats())
        return out

    def request_shutdown(self) -> None:
        self.shutdown_requested.set()
        if self.on_shutdown is not None:
            self.on_shutdown()

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.recorder.sweep()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for background gradings, then for the sink's writes in flight."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        await asyncio.to_thread(self.recorder.sink.flush, timeout_s)


def _logprob_items(token_ids, logprobs) -> list[dict]:
    """OpenAI ``logprobs.content`` items; tokens are named ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
    return [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(token_ids, logprobs)]


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}},
                        headers=headers)


def build_app(service: ChatService):
    # No `from __future__ import annotations` in this module: FastAPI reads the `request: Request` annotations of
    # the nested handlers at definition time, and `Request` is imported here, lazily.
    """The FastAPI app over ``service`` (run it with uvicorn, or :class:`~claas_verl.service.server.ServiceThread`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    class _ClosingStream(StreamingResponse):
        """Closes the event iterator when the response ends in any way. Starlette cancels a response whose client
        disconnected, which can leave the iterator suspended at a ``yield``; closing it runs its clean-up (stop the
        generation, count the disconnect) at once instead of whenever it is garbage-collected."""

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sweeper = asyncio.get_running_loop().create_task(service.sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            await service.drain(timeout_s=10.0)
            await service.backend.aclose()

    app = FastAPI(title="CLaaS chat service", lifespan=lifespan)
    limit = service.config.max_body_bytes

    async def json_body(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise LimitError(f"the request body has {declared} bytes; this service accepts at most {limit}", 413)
        raw = bytearray()
        async for part in request.stream():  # bounded read: a chunked body cannot exceed the limit either
            raw += part
            if len(raw) > limit:
                raise LimitError(f"the request body exceeds {limit} bytes", 413)
        try:
            return json.loads(bytes(raw))
        except ValueError as exc:
            raise ValueError(f"the request body is not valid JSON: {exc}") from None

    def guarded(admin: bool = False):
        """Wrap a handler: auth first, then errors -> OpenAI-style error bodies with the right status."""
        def wrap(fn):
            async def handler(request: Request):
                try:
                    service.authorize(request.headers, admin=admin)
                    return await fn(request)
                except AuthError as exc:
                    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
                    return _error(exc.status, str(exc), "authentication_error", headers)
                except LimitError as exc:
                    return _error(exc.status, str(exc))
                except ValueError as exc:
                    return _error(400, str(exc))
                except (LoRAReloadError, BackendError) as exc:
                    return _error(502, str(exc), "backend_error")
            handler.__name__ = fn.__name__
            return handler
        return wrap

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy_version": service.backend.policy_version,
                "model": service.backend.served_model}

    @app.get("/v1/models")
    @guarded()
    async def models(request: Request):
        now = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now, "owned_by": "claas"}
                                           for name in service.backend.model_names()]}

    @app.post("/v1/chat/completions")
    @guarded()
    async def chat(request: Request):
        body = await json_body(request)
        if isinstance(body, dict) and body.get("stream"):
            events = await service.chat_stream(body, request.headers)
            return _ClosingStream(events, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await service.chat(body, request.headers)

    @app.post("/v1/feedback")
    @guarded()
    async def feedback(request: Request):
        out = service.feedback(await json_body(request))
        if out["status"] == "unknown":
            return JSONResponse(status_code=404, content=out)
        return out

    @app.post("/v1/claas/load_adapter")
    @guarded(admin=True)
    async def load_adapter(request: Request):
        body = await json_body(request)
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise ValueError("'lora_path' must be the path of a peft adapter directory")
        return await service.load_adapter(service.adapter_path(path), body.get("policy_version"))

    @app.post("/v1/claas/shutdown")
    @guarded(admin=True)
    async def shutdown(request: Request):
        service.request_shutdown()
        return {"status": "stopping"}

    @app.get("/v1/claas/stats")
    @guarded()
    async def stats(request: Request):
        return await asyncio.to_thread(service.stats)

    return app
