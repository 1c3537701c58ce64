"""The CLaaS chat service: an OpenAI-compatible chat API that records every assistant turn for training.

Agents point their OpenAI client at this service instead of at vLLM (001: "connects to any agent harness with a
single line of code"). Each response is served as usual and, when recordable, becomes a replay entry once its reward
is known (grader callback or ``POST /v1/feedback``). The trainer hot-reloads new LoRA versions through
:meth:`ChatService.load_adapter` (in process) or ``POST /v1/claas/load_adapter`` (over HTTP).

Endpoints (the HTTP layer is :mod:`claas_verl.service.http_app`)::

    GET  /health                    liveness: 200 {"status": "ok", ...}; 503 when the replay buffer is unreachable
    GET  /ready                     readiness: 503 also while the service drains (intake stopped)
    GET  /metrics                   Prometheus metrics (admin key when keys are configured)
    GET  /v1/models                 OpenAI model list (base + served adapter)
    POST /v1/chat/completions       OpenAI chat completion + a "claas" object (request id, version, record status)
    POST /v1/feedback               {"request_id", "reward": float|null, "feedback": str|null} (the turn's own key)
    POST /v1/claas/load_adapter     {"lora_path", "policy_version"?}  (admin: trainer -> service hot-reload)
    POST /v1/claas/shutdown         admin: stop intake, drain, end the job
    GET  /v1/claas/stats            a key's own counters; with the admin key, every counter and every key's

Request metadata (body ``metadata`` object, or headers; the body wins): ``scenario_id`` / ``X-Claas-Scenario-Id``
(int in [0, 2**63), or any string, mapped to a stable int and kept in the entry's metadata), ``step_idx`` /
``X-Claas-Step-Idx``, ``domain`` / ``X-Claas-Domain``, ``record`` / ``X-Claas-Record`` (false/0 opts out).

Every turn belongs to the API key that created it: only that key can give its feedback (another key gets 404, as
for an unknown id). Feedback is answered ``accepted`` only once the replay buffer acknowledged the entry.
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

import numpy as np

from claas_verl.service.backend import MIXED_VERSION, BackendError, ChatBackend, Generation
from claas_verl.service.buffer_share import BufferShare
from claas_verl.service.grading import Grader, GradeRequest, normalize_grade
from claas_verl.service.guard import (
    DEFAULT_TEMPLATE_KWARGS,
    LOOPBACK_HOSTS,
    RateLimiter,
    bounded_int,
    key_id,
    template_kwargs,
)
from claas_verl.service.recorder import COUNTERS, TrajectoryRecorder, TurnRecord, behaviour_logprob, unrecordable_reason
from claas_verl.service.sampling import SamplingParams, training_violations, violation_message
from claas_verl.service.sinks import make_sink
from claas_verl.service.streaming import StreamStart, TokenDelta
from claas_verl.service.templating import normalize_messages

_FALSE = {"0", "false", "no", "off"}


REWARD_MODES = ("binary", "unit")
#: Retry-After of feedback refused for the buffer share: room comes from other keys' entries or the next policy
#: update, neither of which the service can time
SHARE_RETRY_S = 5.0


class AuthError(PermissionError):
    """A missing or wrong API key (HTTP 401) or a missing admin right (HTTP 403)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LimitError(ValueError):
    """A request over a limit (413 for the body, 429 for a rate or a full queue with ``retry_after`` seconds, 400
    otherwise); the message names the limit."""

    def __init__(self, message: str, status: int = 400, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Unavailable(RuntimeError):
    """The service cannot take the request now (HTTP 503): draining for shutdown, or the replay buffer did not
    acknowledge the entry."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


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
        max_pending_per_key: pending turns one API key may hold (its oldest goes beyond); None: ``max_pending``.
        max_pending_bytes: byte budget of the whole pending table (token arrays, texts kept for a grader).
        max_grading: background gradings in flight; a chat beyond it is answered 429 before generating.
        rate_limit_per_s / rate_limit_burst: per-key token bucket over chat and feedback requests (429 with
            ``Retry-After``); None: no rate limit.
        max_buffer_share: the fraction of the replay buffer (of its capacity ``b_max``) one API key may hold when its
            next entry would push another key's entry out (see :mod:`~claas_verl.service.buffer_share`); feedback
            beyond it is answered 429 with ``Retry-After`` and the turn stays pending. 1.0: no limit. The admin key
            is exempt.
        ack_timeout_s: how long a feedback waits for the replay buffer's acknowledgement (503 after).
        body_timeout_s: how long a request body may take to arrive in full (408 after: a trickling client).
        template_kwargs: the ``chat_template_kwargs`` keys a request may set (values: booleans, numbers, short
            strings); a request never supplies a template.
        api_keys: accepted ``Authorization: Bearer`` keys for every endpoint except ``/health`` / ``/ready``.
        allow_keyless: serve without API keys (explicit opt-in; loopback only, ``Host``/``Origin`` checked, see
            :func:`check_exposure`).
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
    max_pending_per_key: int | None = 1024
    max_pending_bytes: int = 256 << 20
    max_grading: int = 256
    rate_limit_per_s: float | None = None
    rate_limit_burst: int = 20
    max_buffer_share: float = 1.0
    ack_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    template_kwargs: tuple[str, ...] = DEFAULT_TEMPLATE_KWARGS
    api_keys: tuple[str, ...] = ()
    allow_keyless: bool = False
    admin_key: str | None = None
    adapter_root: str | None = None
    reward: str = "binary"
    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_message_chars: int = 32_768
    max_tokens: int | None = None
    default_max_tokens: int | None = None

    def __post_init__(self):
        if self.default_scenario_id is not None:
            bounded_int(self.default_scenario_id, "default_scenario_id")
        if not self.api_keys and not self.allow_keyless:
            raise ValueError("no API keys: set api_keys (claas.service.api_keys or CLAAS_API_KEY), or opt in to a "
                             "keyless loopback service with allow_keyless=True")
        if self.rate_limit_per_s is not None and not self.rate_limit_per_s > 0:
            raise ValueError(f"rate_limit_per_s must be None or > 0, got {self.rate_limit_per_s}")
        share = self.max_buffer_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"max_buffer_share (claas.service.max_buffer_share) must be a number in (0, 1]: the "
                             f"fraction of the replay buffer one API key may hold, 1 for no limit; got {share!r}")
        for name in ("max_pending_bytes", "max_grading", "rate_limit_burst"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("ack_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        object.__setattr__(self, "template_kwargs", tuple(self.template_kwargs or ()))
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
    """Refuse to serve without API keys on anything but a loopback address (anyone could feed the trainer), and
    without keys unless keyless mode was opted in to."""
    if config.api_keys:
        return
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"the chat service would listen on {host!r} without API keys; set claas.service.api_keys "
                         "(or the environment variable CLAAS_API_KEY), or listen on 127.0.0.1")
    if not config.allow_keyless:
        raise ValueError("the chat service has no API keys; set api_keys, or opt in to keyless loopback mode "
                         "(allow_keyless)")


def validate_reward(value: Any, mode: str) -> float | None:
    """The ``reward`` field of ``POST /v1/feedback`` (SPEC A.1.4): ``None`` (grader error: dropped), else a number in
    {0, 1} (``mode="binary"``) or [0, 1] (``mode="unit"``); ``ValueError`` naming the field otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'reward' must be a finite number (or null for a grader error), got {value!r}")
    if isinstance(value, int) and not 0 <= value <= 1:  # compared as an int: a 400-digit integer has no float
        raise ValueError(f"'reward' must be in [0, 1] (SPEC A.1.4), got {str(value)[:20]}")
    if not math.isfinite(value):
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
        return bounded_int(key, "scenario_id"), None
    if isinstance(key, str) and key:
        if key.isdigit():
            return bounded_int(key, "scenario_id"), None
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
        cfg = self.config
        self.recorder = TrajectoryRecorder(make_sink(sink), max_pending=cfg.max_pending,
                                           pending_ttl_s=cfg.pending_ttl_s, max_pending_per_key=cfg.max_pending_per_key,
                                           max_pending_bytes=cfg.max_pending_bytes)
        self._tasks: set[asyncio.Task] = set()
        self.reloads = 0
        self.extra_stats = extra_stats
        self.on_shutdown = on_shutdown
        self.shutdown_requested = threading.Event()
        self.buffer_share = BufferShare(cfg.max_buffer_share)
        if self.buffer_share.enabled and not hasattr(self.recorder.sink, "fill"):
            raise ValueError(f"max_buffer_share={cfg.max_buffer_share} needs a sink that reports the buffer's fill "
                             f"(fill() -> (size, b_max)); {type(self.recorder.sink).__name__} has none: set "
                             "max_buffer_share=1.0 or use a ReplayBuffer / replay actor sink")
        self.rate_limiter = RateLimiter(cfg.rate_limit_per_s, cfg.rate_limit_burst) if cfg.rate_limit_per_s else None
        self._key_ids = {k: key_id(k) for k in cfg.api_keys}
        self._accepting = True  # False once intake stopped (shutdown): chat and feedback answer 503
        self._active = 0  # chat/feedback requests inside the service
        self._idle = threading.Condition()

    # ------------------------------------------------------------------ auth
    def authorize(self, headers: Mapping[str, str], admin: bool = False) -> str:
        """The caller's id (``key-<hash>`` of its API key, ``"admin"``, or ``"local"`` on a keyless service);
        ``AuthError`` unless ``headers`` carry an accepted ``Authorization: Bearer`` key (the admin key for admin
        endpoints). Keys are compared in constant time, every one of them."""
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if admin:
            if self.config.admin_key is None:
                raise AuthError(403, "admin endpoints are disabled: start the service with an admin key "
                                     "(claas.service.admin_key or CLAAS_ADMIN_KEY)")
            if not token or not hmac.compare_digest(token.encode(), self.config.admin_key.encode()):
                raise AuthError(401, "this endpoint needs the admin key: Authorization: Bearer <admin key>")
            return "admin"
        if not self.config.api_keys:
            return "local"
        owner = None
        for key, kid in self._key_ids.items():
            if hmac.compare_digest(token.encode(), key.encode()) and token:
                owner = kid
        if owner is None and self.config.admin_key is not None and token \
                and hmac.compare_digest(token.encode(), self.config.admin_key.encode()):
            owner = "admin"
        if owner is None:
            raise AuthError(401, "missing or wrong API key: send Authorization: Bearer <key> "
                                 "(OpenAI(api_key=...) does this)")
        return owner

    def rate_limit(self, owner: str) -> None:
        """``LimitError`` 429 (with the seconds to wait) when ``owner`` is over its request rate."""
        if self.rate_limiter is None or owner == "admin":
            return
        wait = self.rate_limiter.acquire(owner)
        if wait > 0:
            self.recorder.count("rate_limited", owner=owner)
            raise LimitError(f"rate limit of {self.config.rate_limit_per_s:g} requests/s per API key (bursts of "
                             f"{self.config.rate_limit_burst}) exceeded; retry after {wait:.2f}s", 429, wait)

    # ------------------------------------------------------------------ intake and drain
    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_intake(self) -> None:
        """From now on chat and feedback answer 503 (``/ready`` too); requests already inside finish."""
        self._accepting = False

    @contextlib.contextmanager
    def intake(self):
        """Wraps a chat/feedback request: 503 once intake stopped; counted so :meth:`wait_idle` can wait for it."""
        with self._idle:
            if not self._accepting:
                raise Unavailable("the service is shutting down and takes no new chats or feedback", 30.0)
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block (any thread but the event loop's) until no chat/feedback request is inside; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._active, timeout_s)

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
        ctx["step_idx"] = None if step is None else bounded_int(step, "step_idx")
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

    def _prepare(self, body: dict, headers: Mapping[str, str] | None, owner: str
                 ) -> tuple[SamplingParams, list[dict], dict, dict | None]:
        """Validate a chat request: ``(params, messages, ctx, chat_template_kwargs)``; errors name the field."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        params = self._limit(body, SamplingParams.from_request(body))
        messages = normalize_messages(body.get("messages"))
        self._check_message_sizes(messages)
        ctx = self._context(body, headers or {})
        ctx["owner"] = owner
        kwargs = template_kwargs(body.get("chat_template_kwargs"), self.config.template_kwargs)
        if "chat_template" in body or "tools" in body:
            raise ValueError("'chat_template' and 'tools' are not accepted: the service renders every chat with the "
                             "policy's own template (tool calls are not recorded)")
        if self.grader is not None and not self.config.grade_inline and ctx["record"] \
                and len(self._tasks) >= self.config.max_grading:
            self.recorder.count("rejected_busy", owner=ctx["owner"])
            raise LimitError(f"{len(self._tasks)} turns are waiting for the grader (at most "
                             f"{self.config.max_grading}); retry shortly", 429, 1.0)
        return params, messages, ctx, kwargs

    async def chat(self, body: dict, headers: Mapping[str, str] | None = None, owner: str = "local") -> dict:
        """Serve one chat completion and record it as ``owner``'s turn; returns the OpenAI response dict with a
        ``claas`` object."""
        with self.intake():
            params, messages, ctx, kwargs = self._prepare(body, headers, owner)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            gen = await self.backend.generate(messages, params, kwargs)
            self.recorder.count("served", owner=owner)
            status, reason = await self._record(request_id, gen, params, messages, ctx)
            return self._response(request_id, gen, params, status, reason, ctx)

    async def chat_stream(self, body: dict, headers: Mapping[str, str] | None = None, owner: str = "local"
                          ) -> AsyncIterator[str]:
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
        if not self._accepting:
            raise Unavailable("the service is shutting down and takes no new chats or feedback", 30.0)
        params, messages, ctx, kwargs = self._prepare(body, headers, owner)
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
            self.recorder.count("served", owner=ctx["owner"])
            status, reason = await self._record(request_id, gen, params, messages, ctx)
            outcome = status
            response = self._response(request_id, gen, params, status, reason, ctx)
            yield chunk({}, gen.finish_reason, claas=response["claas"], usage=response["usage"])
            delivered = True
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - a disconnect is a BaseException (CancelledError/GeneratorExit)
            # after the 200 and the first chunk, an error can only be an event (the openai client raises APIError)
            self.recorder.count("dropped_stream_error", owner=ctx["owner"])
            delivered = True
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'backend_error', 'code': 502}})}\n\n"
        finally:
            if not delivered:
                # The client went away (or the server is stopping) before the reply was complete on its side: a
                # generation still running is stopped and never recorded; a complete turn waiting for feedback is
                # withdrawn (no feedback can come for a reply the client did not get). A turn handed to a grader
                # or already settled keeps its outcome: the grader needs no client.
                if outcome is None or (outcome == "pending_feedback" and self.recorder.withdraw(request_id)):
                    self.recorder.count("dropped_disconnected", owner=ctx["owner"])
            # shielded: a response cancelled by its disconnect must still close the backend stream
            with anyio.CancelScope(shield=True):
                await events.aclose()

    async def _record(self, request_id, gen, params, messages, ctx) -> tuple[str, str | None]:
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
        if ctx["scenario_key"] is not None:
            metadata["scenario"] = ctx["scenario_key"]
        if ctx["client_metadata"]:
            metadata["client"] = ctx["client_metadata"]
        graded = self.grader is not None
        record = TurnRecord(
            request_id=request_id, scenario_id=scenario_id, step_idx=ctx["step_idx"],
            prompt_ids=np.asarray(gen.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(gen.response_ids, dtype=np.int32),
            behaviour_logprob=behaviour_logprob(gen.token_logprobs), policy_version=gen.policy_version,
            domain=ctx["domain"], metadata=metadata, owner=owner,
            # the texts are the grader's input only: a turn waiting for feedback keeps its tokens, not its texts
            messages=messages if graded else [], text=gen.text if graded else "",
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
        except Exception as exc:  # any grader failure is a grader error: reward None (SPEC A.1.4)
            self.recorder.count("dropped_grader_error", owner=record.owner)
            return "dropped", f"grader error ({exc!r}): never used for training (SPEC A.1.4)"
        reserved = reward is not None and self.buffer_share.enabled
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
                      reserved: bool = False) -> tuple[str, str | None]:
        """Submit ``record`` with its reward and wait for the buffer: ``("accepted", None)`` once it is in the
        buffer, ``("refused", why)`` when the buffer refused it, ``Unavailable`` when the write failed or was not
        acknowledged within ``ack_timeout_s`` (each counted). ``reserved``: a buffer-share reservation of the owner
        to end with the outcome."""
        status = None
        try:
            status, reason = await self._submit(record, reward, feedback)
            return status, reason
        finally:
            if reserved:
                self.buffer_share.release(record.owner, accepted=status == "accepted")

    async def _submit(self, record: TurnRecord, reward: float | None, feedback: str | None
                      ) -> tuple[str, str | None]:
        status, reason, ack = self.recorder.finish(record, reward, feedback)
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
    async def feedback(self, body: dict, owner: str = "local") -> dict:
        """``POST /v1/feedback``: reward (and feedback text) for ``owner``'s pending turn; status ``accepted`` once the
        buffer holds the entry (``unknown``: no such turn of this key)."""
        with self.intake():
            return await self._feedback(body, owner)

    async def _feedback(self, body: dict, owner: str) -> dict:
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
        reserved = False
        if reward is not None and self.buffer_share.enabled and self.recorder.owns(request_id, owner):
            if await self._share_refused(owner):  # refused before the turn is taken: it stays pending for a retry
                self.recorder.count("rejected_buffer_share", owner=owner)
                raise LimitError(self._share_message(), 429, SHARE_RETRY_S)
            reserved = True
        record = self.recorder.take(request_id, owner)
        if record is None:
            if reserved:
                self.buffer_share.release(owner, accepted=False)
            return {"request_id": request_id, "status": "unknown", "reason": self.recorder.unknown_reason(request_id)}
        status, reason = await self._settle(record, reward, text, reserved=reserved)
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
        if os.path.isdir(real):
            for name in os.listdir(real):  # a file that is a link out of the root would be read from outside it
                target = os.path.realpath(os.path.join(real, name))
                if os.path.commonpath([target, real_root]) != real_root:
                    raise AuthError(403, f"'lora_path' holds {name!r}, a link to {target} outside {real_root}")
            if os.path.exists(os.path.join(real, "adapter_model.bin")):
                raise ValueError("'lora_path' holds adapter_model.bin (pickled weights, which can run code when "
                                 "loaded); save the adapter as adapter_model.safetensors")
        return real

    async def load_adapter(self, path: str, version: int | None = None) -> dict:
        """Serve the LoRA adapter at ``path`` as ``version`` (default current + 1); in-flight requests keep theirs."""
        if version is not None:
            version = bounded_int(version, "policy_version")
        new = await self.backend.load_adapter(path, version)
        self.reloads += 1
        return {"policy_version": new, "model": self.backend.served_model}

    def load_adapter_sync(self, path: str, version: int | None = None) -> dict:
        """:meth:`load_adapter` from a thread with no running event loop (e.g. a trainer's update thread)."""
        return asyncio.run(self.load_adapter(path, version))

    def stats(self) -> dict:
        """The admin view: recorder counters, a ``turns`` summary (recorded, pending, completed, expired, dropped by
        reason), per-key counters under ``keys``, the served version, and whatever ``extra_stats`` adds (the
        training job: buffer statistics and updates)."""
        rec = self.recorder.stats()
        dropped = {name[len("dropped_"):]: rec[name] for name in COUNTERS if name.startswith("dropped_")}
        dropped.update({name: rec[name] for name in COUNTERS if name.startswith("rejected_")})
        out = {**rec, "policy_version": self.backend.policy_version, "model": self.backend.served_model,
               "reloads": self.reloads, "accepting": self._accepting, "keys": self.recorder.key_stats(),
               "buffer_share": self._share_stats(),
               "turns": {"served": rec["served"], "recorded": rec["pending"] + rec["graded"],
                         "pending": rec["pending_now"], "completed": rec["submitted"],
                         "accepted": rec["accepted"], "expired": rec["dropped_timeout"],
                         "dropped": dropped}}
        if self.extra_stats is not None:
            out.update(self.extra_stats())
        return out

    def user_stats(self, owner: str) -> dict:
        """The view of one API key: its own counters and pending turns, its buffer share, the served model and
        version."""
        share = self._share_stats()
        return {"key_id": owner, "policy_version": self.backend.policy_version, "model": self.backend.served_model,
                **self.recorder.key_stats(owner)[owner],
                "buffer_share": {"max": share["max"], "limit": share["limit"], "held": share["held"].get(owner, 0)}}

    def _share_stats(self) -> dict:
        """``max`` (the configured fraction), ``limit`` (entries per key, once the capacity is known) and ``held``
        (per key: entries of the last ``b_max`` it wrote, an upper bound of what it holds in the buffer)."""
        share = self.buffer_share
        return {"max": share.share, "limit": share.limit(share.capacity) if share.capacity else None,
                "held": share.held()}

    def metrics_snapshot(self) -> dict:
        """What :class:`~claas_verl.service.metrics.ServiceMetrics` exports (blocking: the job's extra stats)."""
        rec = self.recorder.stats()
        extra = self.extra_stats() if self.extra_stats is not None else {}
        buffer = extra.get("buffer")
        if buffer is None and hasattr(self.recorder.sink, "buffer"):
            buffer = self.recorder.sink.buffer.stats()
        return {"counts": {name: rec[name] for name in COUNTERS}, "keys": self.recorder.key_stats(),
                "buffer_share_held": self.buffer_share.held() if self.buffer_share.enabled else None,
                "pending_now": rec["pending_now"], "pending_bytes": rec["pending_bytes"],
                "policy_version": self.backend.policy_version, "buffer": buffer, "updates": extra.get("updates"),
                "last_update_unix": extra.get("last_update_unix")}

    def healthy(self) -> bool:
        """Whether the replay buffer answers (blocking: call it off the event loop)."""
        probe = getattr(self.recorder.sink, "healthy", None)
        return True if probe is None else bool(probe())

    def request_shutdown(self) -> None:
        """Stop intake (503 from now on), then tell the owner (a training job drains and takes its final
        checkpoint)."""
        self.stop_intake()
        self.shutdown_requested.set()
        if self.on_shutdown is not None:
            self.on_shutdown()

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.recorder.sweep()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop intake, wait for background gradings (those still running after ``timeout_s`` are cancelled and
        counted ``dropped_shutdown``), then for the sink's writes in flight. Turns still waiting for feedback can
        get none any more: counted ``dropped_shutdown`` too."""
        self.stop_intake()
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=timeout_s)
            for task in late:
                task.cancel()
            if late:
                self.recorder.count("dropped_shutdown", len(late))
        await asyncio.to_thread(self.recorder.sink.flush, timeout_s)
        self.recorder.drop_all("dropped_shutdown")


def _logprob_items(token_ids, logprobs) -> list[dict]:
    """OpenAI ``logprobs.content`` items; tokens are named ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
    return [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(token_ids, logprobs)]


def build_app(service: ChatService):
    """The FastAPI app over ``service`` (see :func:`claas_verl.service.http_app.build_app`)."""
    from claas_verl.service.http_app import build_app as build

    return build(service)
