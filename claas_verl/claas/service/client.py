"""A small synchronous client of the CLaaS chat service (users' scripts, a trainer in another process, tests).

Any OpenAI client works for chatting (``base_url=<service>/v1``; scenario ids go in ``metadata`` or the
``X-Claas-Scenario-Id`` header); this client adds the CLaaS endpoints: feedback, adapter reload and stats.
"""

from __future__ import annotations

from typing import Any


class ClaasServiceError(RuntimeError):
    """The service answered with an error status; ``status`` and ``body`` hold the reply."""

    def __init__(self, status: int, body: Any):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class ClaasServiceClient:
    """``ClaasServiceClient("http://127.0.0.1:8000", api_key=...)``; every method returns the decoded JSON reply.

    ``api_key`` is sent as ``Authorization: Bearer`` on every call; ``admin_key`` instead on the admin calls
    (``load_adapter``, ``shutdown``).
    """

    def __init__(self, base_url: str, timeout_s: float = 120.0, api_key: str | None = None,
                 admin_key: str | None = None):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)

    def _check(self, resp):
        body = resp.json()
        if resp.status_code >= 400:
            raise ClaasServiceError(resp.status_code, body)
        return body

    def chat(self, messages: list[dict], *, scenario_id: int | str | None = None, step_idx: int | None = None,
             record: bool | None = None, headers: dict | None = None, **params) -> dict:
        """``POST /v1/chat/completions``; ``params`` are OpenAI fields (temperature, max_tokens, metadata, ...)."""
        meta = dict(params.pop("metadata", None) or {})
        if scenario_id is not None:
            meta["scenario_id"] = scenario_id
        if step_idx is not None:
            meta["step_idx"] = step_idx
        if record is not None:
            meta["record"] = record
        body = {"model": params.pop("model", "claas"), "messages": messages, **params}
        if meta:
            body["metadata"] = meta
        return self._check(self._http.post("/v1/chat/completions", json=body, headers=headers or {}))

    def feedback(self, request_id: str, reward: float | None, feedback: str | None = None) -> dict:
        """``POST /v1/feedback``; ``reward=None`` reports a grader error (the turn is dropped)."""
        return self._check(self._http.post("/v1/feedback", json={"request_id": request_id, "reward": reward,
                                                                  "feedback": feedback}))

    def load_adapter(self, lora_path: str, policy_version: int | None = None) -> dict:
        """``POST /v1/claas/load_adapter``: serve a new LoRA version (the trainer's hot-reload call)."""
        body: dict[str, Any] = {"lora_path": str(lora_path)}
        if policy_version is not None:
            body["policy_version"] = policy_version
        return self._check(self._http.post("/v1/claas/load_adapter", json=body, headers=self._admin))

    def shutdown(self) -> dict:
        """``POST /v1/claas/shutdown``: end a training job's loop (admin key)."""
        return self._check(self._http.post("/v1/claas/shutdown", headers=self._admin))

    def stats(self) -> dict:
        return self._check(self._http.get("/v1/claas/stats"))

    def health(self) -> dict:
        return self._check(self._http.get("/health"))

    def models(self) -> dict:
        return self._check(self._http.get("/v1/models"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ClaasServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
