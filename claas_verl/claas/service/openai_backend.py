"""Backend that forwards to a vLLM OpenAI-compatible server (the GPU deployment of CLaaS).

Per request it sends the chat to ``POST /v1/chat/completions`` with:

* ``model`` = the currently served LoRA adapter name (leased from an :class:`AdapterSwitch`, so a reload never
  changes the adapter or version of a request already running);
* ``logprobs=true`` (+ ``return_tokens_as_token_ids``): the log-prob of every sampled token. vLLM's default
  ``logprobs_mode`` reports raw log-probs (before temperature/top-k/top-p), which equal the sampling distribution's
  only at τ=1, top_p=1, top_k off; that is why only such requests are recorded (docs/math.md §0);
* ``return_token_ids=true``: the prompt and response token ids as vLLM saw them (vLLM >= 0.10.2). Older servers
  omit them; the response ids are then parsed from the ``token_id:N`` log-prob tokens and the prompt ids are
  rendered locally with ``tokenizer`` (None without a tokenizer: the response is served but not recorded);
* every sampling field explicitly, so vLLM never fills omitted ones from the model's ``generation_config``.

The EOS token is part of vLLM's output token ids and log-probs, so the recorded response includes it.

Streaming (:meth:`OpenAIBackend.stream`) sends the same body with ``stream=true``. vLLM (0.30) then puts
``prompt_token_ids`` on its first chunk and, on every chunk, the delta's sampled ``token_ids`` and their log-probs
(with ``return_token_ids`` it sends a chunk even for a token with no visible text, such as EOS); the final
:class:`~claas_verl.claas.service.backend.Generation` is assembled from exactly those ids and log-probs, so it equals
what the non-streamed request returns for the same sampled tokens. Closing the stream closes the HTTP connection, which
makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
from typing import Any

from claas_verl.claas.service.backend import BackendError, ChatBackend, Generation, next_version
from claas_verl.claas.service.lora_reload import AdapterSwitch, VLLMLoRAClient, strip_v1
from claas_verl.claas.service.sampling import SamplingParams
from claas_verl.claas.service.streaming import StreamStart, TokenDelta
from claas_verl.claas.service.templating import render_prompt_ids

_TOKEN_ID_PREFIX = "token_id:"


class OpenAIBackend(ChatBackend):
    """Forward chats to a vLLM OpenAI server (streamed token by token on request) and hot-reload its LoRA adapters.

    Args:
        base_url: vLLM server, ``http://host:port`` (``/v1`` optional).
        base_model: the model name vLLM serves (``--served-model-name`` or the model path).
        adapter_name / adapter_path: an adapter already loaded (name) or to load now (path) as ``policy_version``.
        policy_version: version of what is served at start (0 = the untrained base or initial adapter).
        tokenizer: a tokenizer object or path, used only when the server returns no prompt token ids.
        api_key: bearer token for a server started with ``--api-key``.
        lora_prefix: adapters are loaded as ``"{lora_prefix}-v{version}"``.
        unload_old: unload a replaced adapter once no request uses it (keeps vLLM's LoRA slots free).
        default_max_tokens: sent when a request gives no ``max_tokens`` (None: the server's default).
        timeout_s: per-request HTTP timeout.
    """

    def __init__(self, base_url: str, base_model: str, *, adapter_name: str | None = None,
                 adapter_path: str | os.PathLike | None = None, policy_version: int = 0, tokenizer: Any = None,
                 api_key: str | None = None, lora_prefix: str = "claas", unload_old: bool = True,
                 default_max_tokens: int | None = None, timeout_s: float = 600.0):
        import httpx

        self.base_url = strip_v1(base_url)
        self.base_model = base_model
        self.lora_prefix = lora_prefix
        self.default_max_tokens = default_max_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self.lora = VLLMLoRAClient(self.base_url, api_key=api_key)
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tokenizer
        # Unloads run on one background thread: a retirement is triggered by the release of the last request on
        # the old adapter, which happens on the event loop, and must not block it on HTTP.
        self._unloader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="claas-unload")
        self._reload_lock = threading.Lock()
        self._digests: dict[int, str] = {}  # version -> adapter digest of the file loaded as it
        self.unload_errors: list[str] = []
        self.unloaded: list[str] = []
        if adapter_path is not None:
            adapter_name = adapter_name or f"{lora_prefix}-v{int(policy_version)}"
            self.lora.load(adapter_name, str(adapter_path))
        self._switch = AdapterSwitch(adapter_name or base_model, int(policy_version),
                                     on_retire=self._retire if unload_old else None, keep=(base_model,))

    streams_tokens = True

    # ------------------------------------------------------------------ interface
    @property
    def served_model(self) -> str:
        return self._switch.current.name

    @property
    def policy_version(self) -> int:
        return self._switch.current.version

    def inflight(self, name: str | None = None) -> int:
        """Requests running on adapter ``name`` (default: the one served now)."""
        return self._switch.inflight(name if name is not None else self.served_model)

    def model_names(self) -> list[str]:
        return sorted({self.base_model, self.served_model})

    async def generate(self, messages, params: SamplingParams, chat_template_kwargs=None) -> Generation:
        with self._switch.acquire() as lease:
            return await self._post_chat(lease.name, lease.name, lease.version, messages, params,
                                         chat_template_kwargs)

    async def stream(self, messages, params: SamplingParams, chat_template_kwargs=None):
        with self._switch.acquire() as lease:  # held until the stream ends or is closed: the adapter stays loaded
            async for item in self._stream_chat(lease.name, lease.name, lease.version, messages, params,
                                                chat_template_kwargs):
                yield item

    async def _post_chat(self, model: str, served_name: str, version: int, messages, params: SamplingParams,
                         chat_template_kwargs) -> Generation:
        """One chat on the server's ``model`` (the adapter leased for it); the result names ``served_name``."""
        body = self._request_body(model, messages, params, chat_template_kwargs)
        try:
            resp = await self._http.post("/v1/chat/completions", json=body)
        except Exception as exc:  # httpx errors: connection refused, timeout
            raise BackendError(f"inference server {self.base_url} unreachable: {exc!r}") from exc
        if resp.status_code == 400:
            raise ValueError(f"the inference server refused the request: {resp.text[:500]}")
        if resp.status_code >= 400:
            raise BackendError(f"inference server answered HTTP {resp.status_code}: {resp.text[:500]}")
        return await asyncio.to_thread(self._parse, resp.json(), served_name, version, messages,
                                       chat_template_kwargs)

    async def _stream_chat(self, model: str, served_name: str, version: int, messages, params: SamplingParams,
                           chat_template_kwargs):
        import httpx

        body = self._request_body(model, messages, params, chat_template_kwargs)
        body["stream"] = True
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")[:500]
                    if resp.status_code == 400:
                        raise ValueError(f"the inference server refused the request: {text}")
                    raise BackendError(f"inference server answered HTTP {resp.status_code}: {text}")
                yield StreamStart(policy_version=version, model=served_name)
                acc = _StreamAccumulator()
                async for line in resp.aiter_lines():
                    delta = acc.add_line(line)
                    if delta is not None:
                        yield delta
                    if acc.done:
                        break
        except httpx.HTTPError as exc:  # connection refused / reset, timeout
            raise BackendError(f"inference server {self.base_url} failed mid-request: {exc!r}") from exc
        yield await asyncio.to_thread(self._parse, acc.response(), served_name, version, messages,
                                      chat_template_kwargs)

    async def load_adapter(self, path, version=None) -> int:
        return await asyncio.to_thread(self._load_adapter_sync, str(path), version)

    def _load_adapter_sync(self, path: str, version: int | None) -> int:
        # Reloads are serialised (two concurrent ones would both pick current+1 and collide on the name). The new
        # adapter is loaded BEFORE the switch, so no request is ever sent to a name vLLM does not know yet.
        with self._reload_lock:
            new = next_version(self.policy_version, version)
            name = f"{self.lora_prefix}-v{new}"
            self.lora.load(name, path)
            digest = _file_digest(path)
            if digest is not None:
                self._digests[new] = digest
                for old in sorted(self._digests)[:-_DIGESTS_KEPT]:
                    del self._digests[old]
            self._switch.switch(name, new)
            return new

    def adapter_sha256(self, tenant: str | None, version: int) -> str | None:
        """The digest of the adapter file loaded as ``version`` (the last few versions; None: the base model, or a
        path this process cannot read, e.g. on the vLLM server's own disk)."""
        return self._digests.get(int(version)) if tenant is None else None

    async def aclose(self) -> None:
        await self._http.aclose()
        self._unloader.shutdown(wait=True)
        self.lora.close()

    # ------------------------------------------------------------------ internals
    def _request_body(self, model: str, messages, params: SamplingParams, chat_template_kwargs) -> dict:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "n": 1,
            "stream": False,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty,
            "min_tokens": params.min_tokens,
            "logprobs": True,
            "top_logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        max_tokens = params.max_tokens or self.default_max_tokens
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.logit_bias:
            body["logit_bias"] = params.logit_bias
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        return body

    def _parse(self, data: dict, model: str, version: int, messages, chat_template_kwargs) -> Generation:
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise BackendError(f"inference server returned no choices: {str(data)[:300]}") from exc
        text = (choice.get("message") or {}).get("content") or ""
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = [float(c["logprob"]) for c in content] if content is not None else None
        response_ids = choice.get("token_ids")
        if response_ids is None and content is not None:
            response_ids = [_parse_token_id(c.get("token", "")) for c in content]
            if any(t is None for t in response_ids):
                response_ids = None
        prompt_ids = data.get("prompt_token_ids")
        if prompt_ids is None and self.tokenizer is not None:
            prompt_ids = render_prompt_ids(self.tokenizer, messages, chat_template_kwargs)
        return Generation(
            prompt_ids=[int(t) for t in prompt_ids] if prompt_ids is not None else None,
            response_ids=[int(t) for t in response_ids] if response_ids is not None else [],
            token_logprobs=logprobs,
            text=text,
            # no finish_reason: the server did not say the response is complete, so it is not (never recorded)
            finish_reason=choice.get("finish_reason") or "incomplete",
            policy_version=version,
            model=model,
        )

    def _retire(self, name: str) -> None:
        def unload():
            try:
                self.lora.unload(name)
                self.unloaded.append(name)
            except Exception as exc:  # a failed unload leaks one LoRA slot; it must not fail any request
                self.unload_errors.append(f"{name}: {exc!r}")

        try:
            self._unloader.submit(unload)
        except RuntimeError:  # executor already shut down (service closing)
            pass


class _StreamAccumulator:
    """Folds vLLM's ``chat.completion.chunk`` events into the body of a non-streamed response (see ``_parse``)."""

    def __init__(self):
        self.text: list[str] = []
        self.content: list[dict] | None = None  # logprobs.content items, if the server sent any
        self.token_ids: list[int] | None = None
        self.prompt_ids: list[int] | None = None
        self.finish_reason: str | None = None
        self.done = False

    def add_line(self, line: str) -> TokenDelta | None:
        if not line.startswith("data:"):
            return None  # blank separators, comments, event names
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise BackendError(f"inference server sent a malformed stream event: {data[:300]}") from exc
        if isinstance(chunk, dict) and chunk.get("error"):
            raise BackendError(f"inference server failed mid-stream: {str(chunk['error'])[:500]}")
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        if not chunk.get("choices"):
            return None  # the usage-only chunk
        choice = chunk["choices"][0]
        text = (choice.get("delta") or {}).get("content") or ""
        items = (choice.get("logprobs") or {}).get("content")
        ids = choice.get("token_ids")
        if items is not None:
            self.content = (self.content or []) + list(items)
        if ids is not None:
            self.token_ids = (self.token_ids or []) + [int(t) for t in ids]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        self.text.append(text)
        if not text and not ids and not items:
            return None  # the role chunk
        if ids is None and items is not None:
            ids = [_parse_token_id(c.get("token", "")) for c in items]
            ids = None if any(t is None for t in ids) else ids
        return TokenDelta(text=text, token_ids=tuple(ids or ()),
                          logprobs=None if items is None else tuple(float(c["logprob"]) for c in items))

    def response(self) -> dict:
        """The accumulated stream as a non-streamed response body."""
        if self.finish_reason is None:
            raise BackendError("the inference server's stream ended before the response was complete "
                               "(no finish_reason)")
        choice: dict[str, Any] = {"message": {"content": "".join(self.text)}, "finish_reason": self.finish_reason,
                                  "logprobs": None if self.content is None else {"content": self.content}}
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        return {"choices": [choice], "prompt_token_ids": self.prompt_ids}


def _parse_token_id(token: str) -> int | None:
    if token.startswith(_TOKEN_ID_PREFIX):
        try:
            return int(token[len(_TOKEN_ID_PREFIX):])
        except ValueError:
            return None
    return None


_DIGESTS_KEPT = 64  # versions whose adapter digest is remembered (requests in flight may still be on an older one)


def _file_digest(path: str) -> str | None:
    """:func:`~claas_verl.claas.tenants.adapters.adapter_file_digest` of ``path`` when it is readable here."""
    import os

    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return None
    from claas_verl.claas.tenants.adapters import adapter_file_digest

    return adapter_file_digest(path)
