"""Backend over the training job's own rollout servers (verl's token-in/token-out ``generate``).

This is what makes the chat API and the trainer ONE loop: inside ``main_claas`` the API routes every chat to the same
rollout replicas the trainer pushes its LoRA adapter to (verl's ``LLMServerClient``: least-loaded replica, vLLM on
GPU, the ``hf`` rollout on CPU). The service renders the chat with the policy's template into prompt ids, the
server samples; the recorded response ids and per-token log-probs are the ones the server returned for the tokens
it actually sampled (no local re-rendering of the response).

Versions (docs/math.md §A.1.1): the policy version of a response is the one that served its first token: the server's
``extra_fields["min_global_steps"]`` (verl's partial-rollout engines report the lowest and highest update count
the response's tokens came from), else ``extra_fields["global_steps"]``, else the version published when the request
started. A response whose ``min_global_steps`` and ``max_global_steps`` differ was resumed across a weight update:
its tokens are not a draw from one policy, so it is served with ``finish_reason="mixed_version"`` and never recorded
(counted ``dropped_mixed_version``). The version the API *announces* (``/health``, new requests' expectation) is
:meth:`RolloutBackend.publish`-ed by the trainer only after ``update_weights`` returned, i.e. after the adapter
reached every replica.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from claas_verl.claas.service.backend import MIXED_VERSION, BackendError, ChatBackend, Generation
from claas_verl.claas.service.sampling import SamplingParams
from claas_verl.claas.service.templating import render_prompt_ids

GenerateFn = Callable[[str, list, dict], Awaitable[Any]]

_ABORTED = ("abort", "aborted")


class RolloutBackend(ChatBackend):
    """Serve chats from verl rollout replicas through ``generate(request_id, prompt_ids, sampling_params)``.

    Args:
        generate: coroutine returning an object with ``token_ids``, ``log_probs``, ``stop_reason`` and
            ``extra_fields`` (verl's ``TokenOutput``).
        tokenizer: the policy tokenizer (chat template, EOS, decoding).
        model_name: the name reported to clients.
        default_max_tokens: response budget of a request without ``max_tokens``.
        max_model_len: context bound of the servers (prompt + response), or None.
        eos_token_ids: ids that end a response with ``finish_reason="stop"``.
        policy_version: the version published at start (the trainer's step count).
    """

    def __init__(self, generate: GenerateFn, tokenizer, *, model_name: str = "claas", default_max_tokens: int = 256,
                 max_model_len: int | None = None, eos_token_ids: list[int] | None = None, policy_version: int = 0):
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        self._generate = generate
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_tokens = int(default_max_tokens)
        self.max_model_len = max_model_len
        eos = set(eos_token_ids or [])
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self._lock = threading.Lock()
        self._version = int(policy_version)

    @property
    def served_model(self) -> str:
        return self.model_name

    @property
    def policy_version(self) -> int:
        return self._version

    def publish(self, version: int) -> None:
        """Announce ``version`` (call after the adapter of that version reached every replica); never goes back."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"published versions never go back: serving v{self._version}, got v{version}")
            self._version = int(version)

    async def generate(self, messages, params: SamplingParams, chat_template_kwargs=None) -> Generation:
        unsupported = params.non_default_processing()
        if unsupported:
            raise ValueError(f"the training job's rollout servers take temperature/top_p/top_k/max_tokens/seed only; "
                             f"leave {sorted(unsupported)} unset")
        published = self._version  # the version announced when the request starts (docs/math.md §A.1.1)
        # Jinja and the tokenizer block: off the event loop, so one request never stalls the others
        prompt_ids = await asyncio.to_thread(render_prompt_ids, self.tokenizer, messages, chat_template_kwargs)
        max_tokens = params.max_tokens or self.default_max_tokens
        if self.max_model_len is not None:
            room = int(self.max_model_len) - len(prompt_ids)
            if room < 1:
                raise ValueError(f"'messages' render to {len(prompt_ids)} prompt tokens; the servers' context is "
                                 f"{self.max_model_len} tokens")
            max_tokens = min(max_tokens, room)
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                    "repetition_penalty": 1.0, "logprobs": True, "max_tokens": int(max_tokens)}
        if params.seed is not None:
            sampling["seed"] = int(params.seed)
        try:
            out = await self._generate(uuid.uuid4().hex, prompt_ids, sampling)
        except ValueError:
            raise
        except Exception as exc:  # a dead replica, a Ray error: the client gets a 502, nothing is recorded
            raise BackendError(f"rollout server failed: {exc!r}") from exc
        tokens = [int(t) for t in out.token_ids]
        logps = None if out.log_probs is None else [float(x) for x in out.log_probs]
        extra = getattr(out, "extra_fields", None) or {}
        first, last = extra.get("min_global_steps"), extra.get("max_global_steps")
        served = first if first is not None else extra.get("global_steps")
        # A server that reports no version: the version published when the request started, which is never newer
        # than the served one (publish follows the push), so age eviction can only be conservative.
        version = int(served) if served is not None else published
        stop = str(getattr(out, "stop_reason", "") or "")
        if first is not None and last is not None and int(first) != int(last):
            finish = MIXED_VERSION  # resumed across an update: tokens from versions first..last
        elif stop in _ABORTED:
            finish = "abort"
        elif tokens and tokens[-1] in self.eos_token_ids:
            finish = "stop"
        else:
            finish = "length"
        return Generation(prompt_ids=list(prompt_ids), response_ids=tokens, token_logprobs=logps,
                          text=self.tokenizer.decode(tokens, skip_special_tokens=True), finish_reason=finish,
                          policy_version=version, model=self.model_name)

    async def load_adapter(self, path, version=None) -> int:
        raise ValueError("this service runs inside a training job: the trainer pushes every new adapter to the "
                         "rollout servers itself (versions follow its updates); loading one by path is refused")
