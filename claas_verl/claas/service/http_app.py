"""The HTTP layer of the chat service (FastAPI): every request passes the same door before reaching the service.

The door, in order: a keyless service checks ``Host``/``Origin`` (DNS rebinding, cross-site pages); the API key is
checked and becomes the caller's id; the per-key rate limit applies; a body must be ``application/json`` (a
cross-site form or ``text/plain`` body cannot be) and is read within ``body_timeout_s`` and ``max_body_bytes`` and
checked for depth, integer range and text (:func:`~claas_verl.claas.service.guard.check_json_tree`). Errors are OpenAI
error bodies naming the field; every request ends in one audit line (logger ``claas_verl.claas.service.audit``: key id,
never the key) and one latency observation (``/metrics``). Docs (``/docs``, ``/redoc``, ``/openapi.json``) are off.
"""

import asyncio
import contextlib
import json
import logging
import time

from claas_verl.claas.service.app import ChatService
from claas_verl.claas.service.backend import BackendError
from claas_verl.claas.service.errors import AuthError, LimitError, Unavailable
from claas_verl.claas.service.guard import check_json_tree, keyless_origin_error
from claas_verl.claas.service.lora_reload import LoRAReloadError

audit_log = logging.getLogger("claas_verl.claas.service.audit")


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}},
                        headers=headers)


def _retry_after(seconds: float | None) -> dict | None:
    return None if seconds is None else {"Retry-After": str(max(1, int(seconds + 0.999)))}


def build_app(service: "ChatService"):
    # No `from __future__ import annotations` in this module: FastAPI reads the `request: Request` annotations of
    # the nested handlers at definition time.
    """The FastAPI app over ``service`` (run it with :class:`~claas_verl.claas.service.server.ServiceThread`, which adds
    the connection limits and timeouts, or with uvicorn)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from claas_verl.claas.service.metrics import ServiceMetrics

    cfg = service.config
    metrics = ServiceMetrics(service.metrics_snapshot)

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

    app = FastAPI(title="CLaaS chat service", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.claas_service = service  # ServiceThread checks its exposure against the host it binds
    limit = cfg.max_body_bytes

    async def json_body(request: Request):
        # a cross-site page can send text/plain or a form without asking; application/json it cannot
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise LimitError(f"Content-Type must be application/json, got {ctype or 'none'!r}", 415)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise LimitError(f"the request body has {declared} bytes; this service accepts at most {limit}", 413)
        raw = bytearray()
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                async for part in request.stream():  # bounded read: a chunked body cannot exceed the limit either
                    raw += part
                    if len(raw) > limit:
                        raise LimitError(f"the request body exceeds {limit} bytes", 413)
        except TimeoutError:
            raise LimitError(f"the request body did not arrive within {cfg.body_timeout_s:g}s", 408) from None
        try:
            body = json.loads(bytes(raw))  # NaN/Infinity literals parse; check_json_tree refuses them by field
        except RecursionError:
            raise ValueError("the request body nests too deeply; send a flatter JSON body") from None
        except ValueError as exc:
            raise ValueError(f"the request body is not valid JSON: {exc}") from None
        check_json_tree(body)
        return body

    def door(request: Request, admin: bool) -> str:
        """The checks every guarded request passes; returns the caller's id."""
        if not cfg.accepted_keys:
            why = keyless_origin_error(request.headers)
            if why is not None:
                raise AuthError(403, why)
        return service.authorize(request.headers, admin=admin)

    def guarded(endpoint: str, admin: bool = False, limited: bool = False):
        """Wrap a handler ``fn(request, owner)``: the door first, then errors -> OpenAI-style error bodies with the
        right status; an audit line and a latency observation for every request."""
        def wrap(fn):
            async def handler(request: Request):
                t0 = time.perf_counter()
                owner, status, note = "-", 500, None
                try:
                    owner = door(request, admin)
                    if limited:
                        service.rate_limit(owner)
                    response = await fn(request, owner)
                    status = getattr(response, "status_code", 200)
                    return response
                except AuthError as exc:
                    status, note = exc.status, str(exc)
                    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
                    return _error(exc.status, str(exc), "authentication_error", headers)
                except LimitError as exc:
                    status, note = exc.status, str(exc)
                    headers = _retry_after(exc.retry_after) or {}
                    if exc.status == 408:
                        headers["Connection"] = "close"
                    return _error(exc.status, str(exc), headers=headers or None)
                except Unavailable as exc:
                    status, note = 503, str(exc)
                    return _error(503, str(exc), "service_unavailable", _retry_after(exc.retry_after))
                except ValueError as exc:
                    status, note = 400, str(exc)
                    return _error(400, str(exc))
                except (LoRAReloadError, BackendError) as exc:
                    status, note = 502, str(exc)
                    return _error(502, str(exc), "backend_error")
                finally:
                    elapsed = time.perf_counter() - t0
                    metrics.observe(endpoint, elapsed)
                    client = request.client.host if request.client else "-"
                    audit_log.info(json.dumps({"key_id": owner, "client": client, "method": request.method,
                                               "path": request.url.path, "status": status,
                                               "request_id": getattr(request.state, "request_id", None),
                                               "ms": round(elapsed * 1e3, 1), "error": note and note[:200]}))
            handler.__name__ = fn.__name__
            return handler
        return wrap

    @app.get("/health")
    async def health():
        """Liveness: the process serves and the replay buffer answers (503 when it is dead or unreachable)."""
        ok = await asyncio.to_thread(service.healthy)
        body = {"status": "ok" if ok else "unhealthy", "policy_version": service.backend.policy_version,
                "model": service.backend.served_model}
        if not ok:
            body["reason"] = "the replay buffer does not answer (actor dead or unreachable)"
        return JSONResponse(status_code=200 if ok else 503, content=body)

    @app.get("/ready")
    async def ready():
        """Readiness: healthy and taking chats (503 while draining for shutdown)."""
        ok = await asyncio.to_thread(service.healthy)
        reason = None if ok else "the replay buffer does not answer (actor dead or unreachable)"
        if not service.accepting:
            reason = "draining: the service takes no new chats or feedback"
        return JSONResponse(status_code=503 if reason else 200,
                            content={"ready": reason is None, "reason": reason})

    @app.get("/metrics")
    @guarded("metrics", admin=bool(cfg.accepted_keys))
    async def prometheus(request: Request, owner: str):
        body, ctype = await asyncio.to_thread(metrics.render)
        return Response(content=body, media_type=ctype)

    @app.get("/v1/models")
    @guarded("models")
    async def models(request: Request, owner: str):
        now = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now, "owned_by": "claas"}
                                           for name in service.model_names(owner)]}

    @app.post("/v1/chat/completions")
    @guarded("chat", limited=True)
    async def chat(request: Request, owner: str):
        body = await json_body(request)
        if isinstance(body, dict) and body.get("stream"):
            events = await service.chat_stream(body, request.headers, owner)
            return _ClosingStream(events, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = await service.chat(body, request.headers, owner)
        request.state.request_id = out["id"]
        return out

    @app.post("/v1/feedback")
    @guarded("feedback", limited=True)
    async def feedback(request: Request, owner: str):
        body = await json_body(request)
        if isinstance(body, dict) and isinstance(body.get("request_id"), str):
            request.state.request_id = body["request_id"][:80]
        out = await service.feedback(body, owner)
        if out["status"] == "unknown":
            return JSONResponse(status_code=404, content=out)
        return out

    @app.post("/v1/claas/load_adapter")
    @guarded("load_adapter", admin=True)
    async def load_adapter(request: Request, owner: str):
        body = await json_body(request)
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise ValueError("'lora_path' must be the path of a peft adapter directory")
        return await service.load_adapter(service.adapter_path(path), body.get("policy_version"), body.get("tenant"))

    @app.post("/v1/claas/shutdown")
    @guarded("shutdown", admin=True)
    async def shutdown(request: Request, owner: str):
        service.request_shutdown()
        return {"status": "stopping"}

    @app.get("/v1/claas/stats")
    @guarded("stats")
    async def stats(request: Request, owner: str):
        if owner == "admin" or not cfg.accepted_keys:  # a keyless (loopback) service has one user: its operator
            return await asyncio.to_thread(service.stats)
        return await asyncio.to_thread(service.user_stats, owner)

    return app
