"""The CLaaS chat service: an OpenAI-compatible chat API that records every assistant turn for training.

Agents point their OpenAI client at this service instead of at vLLM (CLaaS paper: "connects to any agent harness with a
single line of code"). Each response is served as usual and, when recordable, becomes a replay entry once its reward
is known (grader callback or ``POST /v1/feedback``). The trainer hot-reloads new LoRA versions through
:meth:`ChatService.load_adapter` (in process) or ``POST /v1/claas/load_adapter`` (over HTTP).

The HTTP layer is :mod:`claas_verl.claas.service.http_app`, the bookkeeping of turns from response to replay buffer
:mod:`claas_verl.claas.service.turns`, the settings :mod:`claas_verl.claas.service.config`. Endpoints::

    GET  /health                    liveness: 200 {"status": "ok", ...}; 503 when the replay buffer is unreachable
    GET  /ready                     readiness: 503 also while the service drains (intake stopped)
    GET  /metrics                   Prometheus metrics (admin key when keys are configured)
    GET  /v1/models                 OpenAI model list (base + served adapter)
    POST /v1/chat/completions       OpenAI chat completion + a "claas" object (request id, version, record status)
    POST /v1/feedback               {"request_id", "reward": float|null, "feedback": str|null} (the turn's own key;
                                    with SDPO the text is the teacher context, and text with reward null counts)
    POST /v1/claas/load_adapter     {"lora_path", "policy_version"?, "tenant"?}  (admin: trainer -> service
                                    hot-reload; with tenants, "tenant" names the one slot that changes)
    POST /v1/claas/shutdown         admin: stop intake, drain, end the job
    GET  /v1/claas/stats            a key's own counters; with the admin key, every counter and every key's

Request metadata (body ``metadata`` object, or headers; the body wins): ``scenario_id`` / ``X-Claas-Scenario-Id``
(int in [0, 2**63), or any string, mapped to a stable int and kept in the entry's metadata), ``step_idx`` /
``X-Claas-Step-Idx``, ``domain`` / ``X-Claas-Domain``, ``record`` / ``X-Claas-Record`` (false/0 opts out).

Every turn belongs to the API key that created it: only that key can give its feedback (another key gets 404, as
for an unknown id). Feedback is answered ``accepted`` only once the replay buffer acknowledged the entry.

Tenants (``config.tenants``): each key belongs to one tenant, and each tenant has its own
:class:`~claas_verl.claas.service.turns.TurnLedger` (pending table, grading queue, buffer share, counters) writing
its own replay partition, its own rate limit, and its own served adapter (the backend takes ``tenant=``, e.g.
:class:`~claas_verl.claas.service.hf_tenants.TenantHFBackend`). Every reply's ``claas`` object names the ``tenant``,
the ``policy_version`` and the ``adapter_sha256`` that served it. The admin key belongs to no tenant: it reads every
tenant's stats and loads adapters (naming the tenant), but does not chat.
"""

import asyncio
import contextlib
import dataclasses
import hmac
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from claas_verl.claas.service import views
from claas_verl.claas.service.backend import BackendError, ChatBackend, Generation
from claas_verl.claas.service.config import REWARD_MODES, ServiceConfig, check_exposure
from claas_verl.claas.service.errors import AuthError, LimitError, Unavailable
from claas_verl.claas.service.grading import Grader
from claas_verl.claas.service.guard import (
    RateLimiter,
    bounded_int,
    key_id,
    scenario_key_to_id,
    template_kwargs,
    validate_reward,
)
from claas_verl.claas.service.recorder import behaviour_logprob
from claas_verl.claas.service.sampling import SamplingParams
from claas_verl.claas.service.streaming import StreamStart, TokenDelta
from claas_verl.claas.service.teacher import SdpoTeacherContext
from claas_verl.claas.service.templating import normalize_messages
from claas_verl.claas.service.turns import TurnLedger
from claas_verl.claas.tenants.config import DEFAULT_TENANT

# what callers import from here; each is defined in the module whose job it is
__all__ = ["REWARD_MODES", "AuthError", "ChatService", "LimitError", "ServiceConfig", "Unavailable",
           "check_exposure", "scenario_key_to_id", "validate_reward"]

_FALSE = {"0", "false", "no", "off"}


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() not in _FALSE



class ChatService:
    """Chat handling, recording and hot-reload, independent of the HTTP layer (``build_app`` wraps it).

    Args:
        backend: a :class:`~claas_verl.claas.service.backend.ChatBackend`.
        sink: a ``ReplayBuffer``, a ``ReplayBufferActor`` handle or a sink object (see ``make_sink``).
        grader: optional reward callback (see :mod:`claas_verl.claas.service.grading`); without one, rewards come from
            ``POST /v1/feedback``.
        config: :class:`ServiceConfig`.
        teacher: SDPO's teacher-context builder
            (:class:`~claas_verl.claas.service.teacher.SdpoTeacherContext`; a job with ``claas.algorithm=sdpo``
            passes one): feedback text becomes the entry's teacher context, also with reward null.
    """

    def __init__(self, backend: ChatBackend, sink: Any, grader: Grader | None = None,
                 config: ServiceConfig | None = None, extra_stats: Callable[[], dict] | None = None,
                 on_shutdown: Callable[[], None] | None = None, teacher: SdpoTeacherContext | None = None):
        self.backend = backend
        self.config = config or ServiceConfig()
        cfg = self.config
        self.directory = cfg.directory
        self.multi_tenant = not self.directory.implicit
        self._grader = grader
        if self.multi_tenant:
            self._check_tenant_backend()
            # one ledger per tenant, each with the tenant's quotas and a sink into the tenant's replay partition
            self.ledgers = {t: TurnLedger(sink, self._tenant_service_config(t), grader, teacher=teacher, tenant=t)
                            for t in self.directory.names}
            self.turns = self.recorder = self.buffer_share = None  # no service-wide ledger: see ledgers
        else:
            self.turns = TurnLedger(sink, cfg, grader, teacher=teacher)
            self.ledgers = {DEFAULT_TENANT: self.turns}
            self.recorder = self.turns.recorder
            self.buffer_share = self.turns.buffer_share
        self.reloads = 0
        self.extra_stats = extra_stats
        self.on_shutdown = on_shutdown
        self.shutdown_requested = threading.Event()
        self.rate_limiter = RateLimiter(cfg.rate_limit_per_s, cfg.rate_limit_burst) if cfg.rate_limit_per_s else None
        self.tenant_limiters = {t: RateLimiter(c.rate_limit_per_s, c.rate_limit_burst) for t in self.directory.names
                                if self.multi_tenant and (c := self.directory[t]).rate_limit_per_s}
        self._key_ids = {k: key_id(k) for k in cfg.accepted_keys}
        self._owner_tenant = {kid: self.directory.tenant_of(k) for k, kid in self._key_ids.items()}
        self._accepting = True  # False once intake stopped (shutdown): chat and feedback answer 503
        self._active = 0  # chat/feedback requests inside the service
        self._idle = threading.Condition()

    @property
    def grader(self) -> Grader | None:
        return self._grader

    # ------------------------------------------------------------------ tenants
    def _tenant_service_config(self, tenant: str) -> ServiceConfig:
        """The service's settings with ``tenant``'s quotas: its pending bound (the per-key bound within it) and its
        keys' buffer share of its partition."""
        t, cfg = self.directory[tenant], self.config
        per_key = min(cfg.max_pending_per_key or t.max_pending, t.max_pending)
        return dataclasses.replace(cfg, tenants=None, api_keys=t.api_keys, max_pending=t.max_pending,
                                   max_pending_per_key=per_key, max_buffer_share=t.max_buffer_share)

    def _check_tenant_backend(self) -> None:
        """A multi-tenant service needs a backend that serves one adapter per tenant (``served_version(tenant)``,
        ``tenant=`` on generate/stream/load_adapter) and knows every configured tenant."""
        served = getattr(self.backend, "served_version", None)
        if not callable(served):
            raise ValueError(f"claas.service.tenants needs a backend that serves one adapter per tenant (e.g. "
                             f"TenantHFBackend); {type(self.backend).__name__} serves one adapter to every key")
        for tenant in self.directory.names:
            try:
                served(tenant)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"claas.service.tenants.{tenant}: the backend does not serve this tenant ({exc}); "
                                 "build it with every configured tenant") from None

    def tenant_of(self, owner: str) -> str:
        """The tenant of caller ``owner`` (a key id); the single-tenant service answers :data:`DEFAULT_TENANT`.
        ``AuthError`` 403 for the admin key of a multi-tenant service (it belongs to no tenant)."""
        if not self.multi_tenant:
            return DEFAULT_TENANT
        tenant = self._owner_tenant.get(owner)
        if tenant is None:
            raise AuthError(403, "the admin key belongs to no tenant: chat and give feedback with a tenant's key")
        return tenant

    def ledger(self, tenant: str) -> TurnLedger:
        return self.ledgers[tenant]

    def model_names(self, owner: str) -> list[str]:
        """``GET /v1/models`` for ``owner``: with tenants, the base model and the caller's own tenant's served model
        (never another tenant's name or version); the admin and a single-tenant service see the backend's list."""
        if not self.multi_tenant or owner == "admin":
            return self.backend.model_names()
        tenant = self.tenant_of(owner)
        names = {self.backend.served_model}
        own = getattr(self.backend, "tenant_model_name", None)
        if own is not None:
            names.add(own(tenant, self.served_version(tenant)))
        return sorted(names)

    def _backend_kw(self, tenant: str) -> dict:
        """The backend call's tenant argument (a single-tenant backend takes none)."""
        return {"tenant": tenant} if self.multi_tenant else {}

    def served_version(self, tenant: str) -> int:
        """The version ``tenant``'s new requests get."""
        if self.multi_tenant:
            return self.backend.served_version(tenant)
        return self.backend.policy_version

    def adapter_sha256(self, tenant: str, version: int) -> str | None:
        """SHA-256 (:func:`~claas_verl.claas.tenants.adapters.adapter_digest`) of the adapter ``tenant`` is served
        at ``version``; None for the base model (version 0) or a backend that does not report digests."""
        digest = getattr(self.backend, "adapter_sha256", None)
        return None if digest is None else digest(tenant if self.multi_tenant else None, version)
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
        if not self.config.accepted_keys:
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
        """``LimitError`` 429 (with the seconds to wait) when ``owner`` is over its request rate, or its tenant over
        the tenant's."""
        if owner == "admin":
            return
        tenant = self.tenant_of(owner)
        recorder = self.ledgers[tenant].recorder
        if self.rate_limiter is not None:
            wait = self.rate_limiter.acquire(owner)
            if wait > 0:
                recorder.count("rate_limited", owner=owner)
                raise LimitError(f"rate limit of {self.config.rate_limit_per_s:g} requests/s per API key (bursts of "
                                 f"{self.config.rate_limit_burst}) exceeded; retry after {wait:.2f}s", 429, wait)
        limiter = self.tenant_limiters.get(tenant)
        if limiter is not None:
            wait = limiter.acquire(tenant)
            if wait > 0:
                recorder.count("rate_limited", owner=owner)
                raise LimitError(f"tenant {tenant!r} is over its rate limit of {limiter.rate:g} requests/s (bursts of "
                                 f"{limiter.burst:g}, claas.service.tenants.{tenant}.rate_limit_per_s); retry after "
                                 f"{wait:.2f}s", 429, wait)

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
        ctx["tenant"] = self.tenant_of(owner)
        ledger = self.ledgers[ctx["tenant"]]
        kwargs = template_kwargs(body.get("chat_template_kwargs"), self.config.template_kwargs)
        ctx["template_kwargs"] = kwargs  # SDPO renders the turn's teacher context with the same template arguments
        if "chat_template" in body or "tools" in body:
            raise ValueError("'chat_template' and 'tools' are not accepted: the service renders every chat with the "
                             "policy's own template (tool calls are not recorded)")
        if ctx["record"] and ledger.grading_full():
            ledger.recorder.count("rejected_busy", owner=ctx["owner"])
            raise LimitError(f"{ledger.grading} turns are waiting for the grader (at most "
                             f"{self.config.max_grading}); retry shortly", 429, 1.0)
        return params, messages, ctx, kwargs

    async def chat(self, body: dict, headers: Mapping[str, str] | None = None, owner: str = "local") -> dict:
        """Serve one chat completion and record it as ``owner``'s turn; returns the OpenAI response dict with a
        ``claas`` object."""
        with self.intake():
            params, messages, ctx, kwargs = self._prepare(body, headers, owner)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            gen = await self.backend.generate(messages, params, kwargs, **self._backend_kw(ctx["tenant"]))
            ledger = self.ledgers[ctx["tenant"]]
            ledger.recorder.count("served", owner=owner)
            status, reason = await ledger.record(request_id, gen, params, messages, ctx)
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
        events = self.backend.stream(messages, params, kwargs, **self._backend_kw(ctx["tenant"]))
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
        head = {"request_id": request_id, "tenant": ctx["tenant"], "policy_version": start.policy_version,
                "adapter_sha256": self.adapter_sha256(ctx["tenant"], start.policy_version),
                "scenario_id": ctx["scenario_id"], "step_idx": ctx["step_idx"]}
        ledger = self.ledgers[ctx["tenant"]]

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
            ledger.recorder.count("served", owner=ctx["owner"])
            status, reason = await ledger.record(request_id, gen, params, messages, ctx)
            outcome = status
            response = self._response(request_id, gen, params, status, reason, ctx)
            yield chunk({}, gen.finish_reason, claas=response["claas"], usage=response["usage"])
            delivered = True
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - a disconnect is a BaseException (CancelledError/GeneratorExit)
            # after the 200 and the first chunk, an error can only be an event (the openai client raises APIError)
            ledger.recorder.count("dropped_stream_error", owner=ctx["owner"])
            delivered = True
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'backend_error', 'code': 502}})}\n\n"
        finally:
            if not delivered:
                # The client went away (or the server is stopping) before the reply was complete on its side: a
                # generation still running is stopped and never recorded; a complete turn waiting for feedback is
                # withdrawn (no feedback can come for a reply the client did not get). A turn handed to a grader
                # or already settled keeps its outcome: the grader needs no client.
                if outcome is None or (outcome == "pending_feedback" and ledger.recorder.withdraw(request_id)):
                    ledger.recorder.count("dropped_disconnected", owner=ctx["owner"])
            # shielded: a response cancelled by its disconnect must still close the backend stream
            with anyio.CancelScope(shield=True):
                await events.aclose()


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
                "tenant": ctx["tenant"],
                "policy_version": gen.policy_version,
                "adapter_sha256": self.adapter_sha256(ctx["tenant"], gen.policy_version),
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
            # another tenant's request id is not in this tenant's ledger: "unknown" (404), as another key's turn
            return await self.ledgers[self.tenant_of(owner)].feedback(body, owner)

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

    async def load_adapter(self, path: str, version: int | None = None, tenant: str | None = None,
                           probe=None) -> dict:
        """Serve the LoRA adapter at ``path`` as ``version`` (default current + 1); in-flight requests keep theirs.
        A multi-tenant service needs ``tenant`` (only that tenant's serving slot changes); ``probe`` (a
        :class:`~claas_verl.claas.tenants.verify.ReloadProbe`) verifies the new adapter before it is served."""
        if version is not None:
            version = bounded_int(version, "policy_version")
        kw = {} if probe is None else {"probe": probe}
        if self.multi_tenant:
            if tenant not in self.directory.names:
                raise ValueError(f"'tenant' must name the tenant whose adapter this is; tenants: "
                                 f"{list(self.directory.names)}")
            kw["tenant"] = tenant
        elif tenant not in (None, DEFAULT_TENANT):
            raise ValueError(f"this service has no tenants; 'tenant' must be absent, got {tenant!r}")
        new = await self.backend.load_adapter(path, version, **kw)
        self.reloads += 1
        t = tenant if self.multi_tenant else DEFAULT_TENANT
        return {"tenant": t, "policy_version": new, "adapter_sha256": self.adapter_sha256(t, new),
                "model": self.backend.served_model}

    def load_adapter_sync(self, path: str, version: int | None = None, tenant: str | None = None,
                          probe=None) -> dict:
        """:meth:`load_adapter` from a thread with no running event loop (e.g. a trainer's update thread)."""
        return asyncio.run(self.load_adapter(path, version, tenant, probe))

    def stats(self) -> dict:
        """The admin view (:func:`~claas_verl.claas.service.views.admin_stats`)."""
        return views.admin_stats(self)

    def tenant_stats(self, tenant: str) -> dict:
        """One tenant's view (:func:`~claas_verl.claas.service.views.tenant_stats`)."""
        return views.tenant_stats(self, tenant)

    def user_stats(self, owner: str) -> dict:
        """The view of one API key (:func:`~claas_verl.claas.service.views.user_stats`)."""
        return views.user_stats(self, owner)

    def metrics_snapshot(self) -> dict:
        """What :class:`~claas_verl.claas.service.metrics.ServiceMetrics` exports
        (:func:`~claas_verl.claas.service.views.metrics_snapshot`; blocking: the job's extra stats)."""
        return views.metrics_snapshot(self)

    def healthy(self) -> bool:
        """Whether the replay buffer answers (blocking: call it off the event loop)."""
        for ledger in self.ledgers.values():
            probe = getattr(ledger.recorder.sink, "healthy", None)
            if probe is not None and not probe():
                return False
        return True

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
            for ledger in self.ledgers.values():
                ledger.recorder.sweep()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop intake, then settle what is left (:meth:`TurnLedger.drain`: gradings, writes in flight, pending
        turns; whatever cannot finish is counted ``dropped_shutdown``)."""
        self.stop_intake()
        await asyncio.gather(*(ledger.drain(timeout_s) for ledger in self.ledgers.values()))


def _logprob_items(token_ids, logprobs) -> list[dict]:
    """OpenAI ``logprobs.content`` items; tokens are named ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
    return [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(token_ids, logprobs)]

