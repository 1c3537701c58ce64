"""The pluggable inference-backend interface of the chat service.

A backend turns chat messages into one sampled response and reports everything a replay entry needs: the prompt
token ids (the chat context as templated for the policy), the response token ids INCLUDING the EOS token, the
log-prob of every sampled token under the sampling distribution, and the policy version (update count of the weights)
that served the request. Backends also hot-swap the served LoRA adapter (``load_adapter``) so that a request keeps
the version it started with.

Backends stream (``stream``): they yield the tokens as they are sampled and end with the same ``Generation`` a
non-streamed request gets (see :mod:`claas_verl.claas.service.streaming`). A backend that cannot stream inherits the
default, which yields the whole response as one delta once it is complete (``streams_tokens = False``).

Implementations: :class:`~claas_verl.claas.service.hf_backend.HFBackend` (in-process transformers model, CPU),
:class:`~claas_verl.claas.service.openai_backend.OpenAIBackend` (forwards to a vLLM OpenAI-compatible server) and
:class:`~claas_verl.claas.service.rollout_backend.RolloutBackend` (the training job's verl rollout servers; whole
responses).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass

from claas_verl.claas.service.sampling import SamplingParams
from claas_verl.claas.service.streaming import StreamStart, TokenDelta

#: ``finish_reason`` of a response whose tokens came from more than one policy version (served, never recorded)
MIXED_VERSION = "mixed_version"


class BackendError(RuntimeError):
    """The inference backend failed (unreachable, bad response); the HTTP layer answers 502."""


class AdapterRejected(ValueError):
    """A reloaded adapter failed its serving probe (:mod:`claas_verl.claas.tenants.verify`): the backend dropped it
    and still serves the previous version."""


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

    #: True when :meth:`stream` yields tokens while they are generated; False: one delta once the response is done.
    streams_tokens: bool = False

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

    async def stream(self, messages: list[dict], params: SamplingParams, chat_template_kwargs: dict | None = None,
                     **tenant) -> AsyncIterator[StreamStart | TokenDelta | Generation]:
        """Sample one response and yield it as it is generated: a :class:`StreamStart`, :class:`TokenDelta` events,
        then the complete :class:`Generation` (what :meth:`generate` returns for the same sampled tokens).

        Errors before the :class:`StreamStart` are the request's errors (``ValueError``: refused; ``BackendError``).
        Closing the iterator early (``aclose``: the client went away) stops the generation where the backend can.
        This default generates the whole response first and yields it as a single delta. ``tenant`` (a
        multi-tenant backend's ``tenant=``) is passed on to :meth:`generate`.
        """
        gen = await self.generate(messages, params, chat_template_kwargs, **tenant)
        yield StreamStart(policy_version=gen.policy_version, model=gen.model)
        if gen.response_ids or gen.text:
            yield TokenDelta(text=gen.text, token_ids=tuple(gen.response_ids),
                             logprobs=None if gen.token_logprobs is None else tuple(gen.token_logprobs))
        yield gen

    @abc.abstractmethod
    async def load_adapter(self, path: str, version: int | None = None) -> int:
        """Serve the LoRA adapter at ``path`` from now on as policy ``version`` (default: current + 1).

        Requests already running finish with the weights and version they started with. Returns the new version.
        ``version`` must be greater than the current one (versions count updates; they never go back). A backend
        that verifies reloads also takes ``probe`` (a :class:`~claas_verl.claas.tenants.verify.ReloadProbe`): it
        scores the probe with the new adapter before serving it and raises :class:`AdapterRejected` (keeping the
        previous version) when the probe's ``accept`` refuses it.
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
