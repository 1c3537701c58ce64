"""The pluggable inference-backend interface of the chat service.

A backend turns chat messages into one sampled response and reports everything a replay entry needs: the prompt
token ids (the chat context as templated for the policy), the response token ids INCLUDING the EOS token, the
log-prob of every sampled token under the sampling distribution, and the policy version (update count of the weights)
that served the request. Backends also hot-swap the served LoRA adapter (``load_adapter``) so that a request keeps
the version it started with.

Implementations: :class:`~claas_verl.service.hf_backend.HFBackend` (in-process transformers model, CPU) and
:class:`~claas_verl.service.openai_backend.OpenAIBackend` (forwards to a vLLM OpenAI-compatible server).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from claas_verl.service.sampling import SamplingParams


class BackendError(RuntimeError):
    """The inference backend failed (unreachable, bad response); the HTTP layer answers 502."""


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    Fields:
        prompt_ids: the full chat context fed to the policy (``None`` if the backend cannot tell; then the response
            is served but not recorded).
        response_ids: sampled token ids, including EOS when the response stopped on it.
        token_logprobs: ``log_softmax(logits/τ)[y_j]`` for each response token (same length), or ``None``.
        text: the visible decoded response (special tokens removed).
        finish_reason: ``"stop"`` (EOS/stop) or ``"length"`` (max_tokens reached).
        policy_version: update count of the weights that produced THIS response (captured when it started).
        model: the served model/adapter name that produced it.
    """

    prompt_ids: list[int] | None
    response_ids: list[int]
    token_logprobs: list[float] | None
    text: str
    finish_reason: str
    policy_version: int
    model: str


class ChatBackend(abc.ABC):
    """Interface of an inference backend (all methods are safe to call concurrently)."""

    @property
    @abc.abstractmethod
    def served_model(self) -> str:
        """Name of the model/adapter new requests go to."""

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Policy version new requests get (update count of the served weights)."""

    @abc.abstractmethod
    async def generate(self, messages: list[dict], params: SamplingParams, chat_template_kwargs: dict | None = None
                       ) -> Generation:
        """Sample one response to ``messages`` with ``params``; ``ValueError`` for a request the backend refuses."""

    @abc.abstractmethod
    async def load_adapter(self, path: str, version: int | None = None) -> int:
        """Serve the LoRA adapter at ``path`` from now on as policy ``version`` (default: current + 1).

        Requests already running finish with the weights and version they started with. Returns the new version.
        ``version`` must be greater than the current one (versions count updates; they never go back).
        """

    def model_names(self) -> list[str]:
        """Names listed by ``GET /v1/models``."""
        return [self.served_model]

    async def aclose(self) -> None:
        """Release connections/threads; idempotent. The default holds nothing to release."""
        return None


def next_version(current: int, version: int | None) -> int:
    """The version a reload installs: ``current + 1`` by default; an explicit one must be an int > ``current``."""
    if version is None:
        return current + 1
    if isinstance(version, bool) or not isinstance(version, int) or version <= current:
        raise ValueError(f"version must be an int greater than the served policy version {current}, got {version!r}")
    return version
