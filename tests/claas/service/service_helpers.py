"""Shared helpers of the service tests (imported by path-unique name; tests dirs have no __init__)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable

import torch

from claas_verl.claas.replay import ReplayBuffer
from claas_verl.claas.service import ChatBackend, ChatService, Generation, ServiceConfig, build_app
from claas_verl.claas.service.server import ServiceThread

ADMIN = "test-admin-key"  # admin key of running_service (adapter loads need it)

USER = [{"role": "system", "content": "Never reveal the word PINEAPPLE."},
        {"role": "user", "content": "What is 2+3?"}]


def wait_until(predicate: Callable[[], object], what: str | Callable[[], object], timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout_s`` with ``what`` (a callable is read then,
    so the message can carry state that only exists at the failure). Tests wait on an observable event (a
    backend saw the chat, a counter moved), never on a fixed sleep: a sleep is a guess about the scheduler and is
    the race that a busy CI machine loses."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for: {what() if callable(what) else what}")
        time.sleep(0.02)


def big_buffer() -> ReplayBuffer:
    # b_min=1 so any entry makes it ready; a_max large so nothing ages out during a test.
    return ReplayBuffer(b_max=1000, b_min=1, a_max=1000, seed=0)


@contextlib.contextmanager
def running_service(backend, sink, grader=None, teacher=None, **config):
    """A ChatService over ``backend`` served by uvicorn on 127.0.0.1 (free port); yields (service, url).
    ``teacher``: SDPO's teacher-context builder (``SdpoTeacherContext``), as a job with ``claas.algorithm=sdpo`` has.

    Adapter loads over HTTP need ``ADMIN`` and a path under the temp directory unless the test overrides them."""
    config.setdefault("admin_key", ADMIN)
    if not config.get("api_keys") and not config.get("tenants"):
        config.setdefault("allow_keyless", True)  # a loopback test service: keyless by explicit opt-in
    config.setdefault("adapter_root", tempfile.gettempdir())
    service = ChatService(backend, sink, grader=grader, config=ServiceConfig(**config), teacher=teacher)
    server = ServiceThread(build_app(service)).start()
    try:
        yield service, server.url
    finally:
        server.stop()


@torch.no_grad()
def recompute_token_logprobs(model, prompt_ids, response_ids) -> list[float]:
    """log_softmax(logits/1)[y_j] of every response token from ONE full forward pass over prompt+response (no KV
    cache)."""
    prompt_ids = [int(t) for t in prompt_ids]
    response_ids = [int(t) for t in response_ids]
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0].float()
    # logits at position i predict token i+1: the response tokens are predicted by positions len(prompt)-1 .. -2.
    pred = logits[len(prompt_ids) - 1 : -1]
    logp = torch.log_softmax(pred, dim=-1).gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)
    return [float(x) for x in logp]


def recompute_logprob(model, prompt_ids, response_ids) -> float:
    """Σ_j log_softmax(logits/1)[y_j] (see :func:`recompute_token_logprobs`), summed in fp64."""
    return float(torch.tensor(recompute_token_logprobs(model, prompt_ids, response_ids), dtype=torch.float64).sum())


class Scripted(ChatBackend):
    """A backend answering every chat with the same three tokens (log-probs -1, -2, -3); ``delay_s`` makes each
    generation take that long (a busy model), without blocking the event loop."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.version = 0
        self.seen_kwargs: list = []

    @property
    def served_model(self):
        return "scripted"

    @property
    def policy_version(self):
        return self.version

    async def generate(self, messages, params, chat_template_kwargs=None):
        import asyncio

        self.seen_kwargs.append(chat_template_kwargs)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return Generation(prompt_ids=[1, 2, 3], response_ids=[7, 8, 2], token_logprobs=[-1.0, -2.0, -3.0],
                          text="ok!", finish_reason="stop", policy_version=self.version, model="scripted")

    async def load_adapter(self, path, version=None):
        self.version = self.version + 1 if version is None else version
        return self.version
