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
import time
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from claas_verl.service.backend import BackendError, ChatBackend
from claas_verl.service.grading import Grader, GradeRequest, normalize_grade
from claas_verl.service.lora_reload import LoRAReloadError
from claas_verl.service.recorder import TrajectoryRecorder, TurnRecord, behaviour_logprob, unrecordable_reason
from claas_verl.service.sampling import SamplingParams, training_violations, violation_message
from claas_verl.service.sinks import make_sink
from claas_verl.service.templating import normalize_messages

_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class ServiceConfig:
    """Service settings.

    Fields:
        record: record turns at all (False: a plain proxy).
        default_scenario_id: scenario id of requests that give none; ``None`` makes such requests unrecordable.
        max_pending / pending_ttl_s: bound and timeout of the table of turns awaiting feedback.
        grade_inline: with a grader, grade before answering (the response then carries the final status); by
            default grading runs after the response is sent, off the chat latency.
        sweep_interval_s: how often expired pending turns are dropped in the background.
    """

    record: bool = True
    default_scenario_id: int | None = 0
    max_pending: int = 4096
    pending_ttl_s: float = 600.0
    grade_inline: bool = False
    sweep_interval_s: float = 5.0

    def __post_init__(self):
        if self.default_scenario_id is not None and (not isinstance(self.default_scenario_id, int)
                                                     or self.default_scenario_id < 0):
            raise ValueError(f"default_scenario_id must be None or an int >= 0, got {self.default_scenario_id!r}")
        if not self.sweep_interval_s > 0:
            raise ValueError(f"sweep_interval_s must be > 0, got {self.sweep_interval_s}")


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
                 config: ServiceConfig | None = None):
        self.backend = backend
        self.config = config or ServiceConfig()
        self.grader = grader
        self.recorder = TrajectoryRecorder(make_sink(sink), max_pending=self.config.max_pending,
                                           pending_ttl_s=self.config.pending_ttl_s)
        self._tasks: set[asyncio.Task] = set()
        self.reloads = 0

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

    async def chat(self, body: dict, headers: Mapping[str, str] | None = None) -> dict:
        """Serve one chat completion and record it; returns the OpenAI response dict with a ``claas`` object."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        params = SamplingParams.from_request(body)
        messages = normalize_messages(body.get("messages"))
        ctx = self._context(body, headers or {})
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("'chat_template_kwargs' must be an object")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await self.backend.generate(messages, params, kwargs)
        self.recorder.count("served")
        status, reason = await self._record(request_id, gen, params, messages, ctx)
        return self._response(request_id, gen, params, status, reason, ctx)

    async def _record(self, request_id, gen, params, messages, ctx) -> tuple[str, str | None]:
        if not ctx["record"]:
            self.recorder.count("not_recorded")
            return "not_recorded", "recording is off for this request"
        violations = training_violations(params)
        if violations:
            self.recorder.count("rejected_sampling")
            return "rejected", violation_message(violations)
        scenario_id = ctx["scenario_id"] if ctx["scenario_id"] is not None else self.config.default_scenario_id
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
            choice["logprobs"] = {"content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(gen.response_ids, gen.token_logprobs)
            ]}
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
            raise ValueError("'reward' is required: a finite number, or null for a grader error (dropped)")
        reward, text = normalize_grade((body["reward"], body.get("feedback")))
        status, reason = self.recorder.feedback(request_id, reward, text)
        return {"request_id": request_id, "status": status, "reason": reason}

    async def load_adapter(self, path: str, version: int | None = None) -> dict:
        """Serve the LoRA adapter at ``path`` as ``version`` (default current + 1); in-flight requests keep theirs."""
        new = await self.backend.load_adapter(path, version)
        self.reloads += 1
        return {"policy_version": new, "model": self.backend.served_model}

    def load_adapter_sync(self, path: str, version: int | None = None) -> dict:
        """:meth:`load_adapter` from a thread with no running event loop (e.g. a trainer's update thread)."""
        return asyncio.run(self.load_adapter(path, version))

    def stats(self) -> dict:
        return {**self.recorder.stats(), "policy_version": self.backend.policy_version,
                "model": self.backend.served_model, "reloads": self.reloads}

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.recorder.sweep()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for background gradings, then for the sink's writes in flight."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        await asyncio.to_thread(self.recorder.sink.flush, timeout_s)


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def build_app(service: ChatService):
    # No `from __future__ import annotations` in this module: FastAPI reads the `request: Request` annotations of
    # the nested handlers at definition time, and `Request` is imported here, lazily.
    """The FastAPI app over ``service`` (run it with uvicorn, or :class:`~claas_verl.service.server.ServiceThread`)."""
    from fastapi import FastAPI, Request

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

    async def json_body(request: Request):
        try:
            return await request.json()
        except ValueError as exc:
            raise ValueError(f"the request body is not valid JSON: {exc}") from None

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy_version": service.backend.policy_version,
                "model": service.backend.served_model}

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now, "owned_by": "claas"}
                                           for name in service.backend.model_names()]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            return await service.chat(await json_body(request), request.headers)
        except ValueError as exc:
            return _error(400, str(exc))
        except BackendError as exc:
            return _error(502, str(exc), "backend_error")

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        try:
            out = service.feedback(await json_body(request))
        except ValueError as exc:
            return _error(400, str(exc))
        if out["status"] == "unknown":
            from fastapi.responses import JSONResponse

            return JSONResponse(status_code=404, content=out)
        return out

    @app.post("/v1/claas/load_adapter")
    async def load_adapter(request: Request):
        try:
            body = await json_body(request)
            path = body.get("lora_path") if isinstance(body, dict) else None
            if not isinstance(path, str) or not path:
                raise ValueError("'lora_path' must be the path of a peft adapter directory")
            return await service.load_adapter(path, body.get("policy_version"))
        except ValueError as exc:
            return _error(400, str(exc))
        except (LoRAReloadError, BackendError) as exc:
            return _error(502, str(exc), "backend_error")

    @app.get("/v1/claas/stats")
    async def stats():
        return service.stats()

    return app
