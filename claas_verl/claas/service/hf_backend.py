"""In-process transformers backend (CPU): the tiny model in tests, any HF causal LM for local demos.

Sampling reuses ``sample_next_token`` (``claas_verl.utils.generation``), the CPU rollout's sampler, so the recorded
per-token log-prob is ``log_softmax(logits / τ)[token]`` of the full vocabulary, before top-k/top-p truncation,
exactly as the rollout the trainer uses on CPU reports it.

Concurrency and versions: one generation runs at a time (a thread lock; the work runs in a worker thread so the
event loop keeps serving). The model, the adapter and the policy version are read under that lock when a request
starts, and ``load_adapter`` takes the same lock, so a reload waits for the running request and the version
recorded for a response is always the one whose weights produced it.

Verified reloads: ``load_adapter(path, probe=ReloadProbe(ids, accept))`` loads the new adapter next to the served
one, scores the probe tokens with it (teacher-forced, :func:`~claas_verl.claas.tenants.verify.probe_token_logprobs`)
and serves it only if ``accept`` says so; otherwise the new adapter is dropped, the previous version stays served and
:class:`~claas_verl.claas.service.backend.AdapterRejected` is raised.

Streaming: the generation thread hands every sampled token to the event loop as it is sampled (a
:class:`~claas_verl.claas.service.streaming.TokenDelta` with its incrementally decoded text); the final
:class:`~claas_verl.claas.service.backend.Generation` is built from the same token ids and log-probs as a non-streamed
request. Closing the stream early (the client went away) stops the generation after the token being computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable

from claas_verl.claas.service.backend import AdapterRejected, ChatBackend, Generation, next_version
from claas_verl.claas.service.sampling import SamplingParams
from claas_verl.claas.service.streaming import IncrementalDetokenizer, StreamStart, TokenDelta
from claas_verl.claas.service.templating import render_prompt_ids

_END = object()  # end-of-stream marker on the generation thread's queue


class HFBackend(ChatBackend):
    """Serve an HF causal LM (optionally with a peft LoRA adapter) in this process (streams token by token).

    Args:
        model_path: HF model directory (e.g. ``ensure_tiny().student``).
        tokenizer_path: defaults to ``model_path``.
        adapter_path: a peft adapter directory to serve from the start (as ``policy_version``).
        model_name: name reported to clients; adapters are served as ``"{model_name}-lora-v{version}"``.
        default_max_tokens: response budget when a request gives no ``max_tokens``.
        policy_version: version of the initial weights (0 = untrained).
        seed: seed of the backend's sampling generator (requests with ``seed`` use their own generator).
        num_threads: ``torch.set_num_threads`` for generation (None leaves torch's setting).
    """

    streams_tokens = True

    def __init__(self, model_path: str | os.PathLike, *, tokenizer_path: str | os.PathLike | None = None,
                 adapter_path: str | os.PathLike | None = None, model_name: str = "claas-hf",
                 default_max_tokens: int = 64, policy_version: int = 0, seed: int = 0,
                 num_threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from claas_verl.utils.generation import eos_token_ids, sample_next_token

        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self._torch = torch
        self._sample = sample_next_token
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
        self.model_name = model_name
        self.default_max_tokens = int(default_max_tokens)
        self.max_model_len = getattr(self.model.config, "max_position_embeddings", None)
        self.eos_token_ids = set(eos_token_ids(self.model, self.tokenizer))
        self._generator = torch.Generator().manual_seed(int(seed))
        self._lock = threading.Lock()
        self._version = int(policy_version)
        self._adapter: str | None = None
        self._digest: str | None = None  # adapter_digest of the served adapter file (None: the base model)
        self.stopped_early = 0  # generations stopped before their end because the stream was closed
        if adapter_path is not None:
            self._load_adapter_locked(str(adapter_path), self._version)

    # ------------------------------------------------------------------ interface
    @property
    def served_model(self) -> str:
        return self.model_name if self._adapter is None else f"{self.model_name}-lora-v{self._version}"

    @property
    def policy_version(self) -> int:
        return self._version

    def model_names(self) -> list[str]:
        return sorted({self.model_name, self.served_model})

    def adapter_sha256(self, tenant: str | None, version: int) -> str | None:
        """The digest of the adapter served at ``version`` while it is the served one (None: the base model or a
        replaced version; the single-tenant backend keeps only its served adapter)."""
        return self._digest if tenant is None and int(version) == self._version else None

    def _prepare(self, messages, params: SamplingParams, chat_template_kwargs) -> tuple[list[int], int]:
        unsupported = params.non_default_processing()
        if unsupported:
            raise ValueError(f"the HF backend does not implement {sorted(unsupported)}; leave them unset")
        prompt_ids = render_prompt_ids(self.tokenizer, messages, chat_template_kwargs)
        max_tokens = params.max_tokens or self.default_max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise ValueError(
                    f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}"
                )
            max_tokens = min(max_tokens, room)
        return prompt_ids, max_tokens

    async def generate(self, messages, params: SamplingParams, chat_template_kwargs=None,
                       tenant: str | None = None) -> Generation:
        # rendering runs Jinja and the tokenizer: off the event loop, so one request never stalls the others
        prompt_ids, max_tokens = await asyncio.to_thread(self._prepare, messages, params, chat_template_kwargs)
        return await asyncio.to_thread(self._generate_locked, prompt_ids, params, max_tokens, tenant=tenant)

    async def stream(self, messages, params: SamplingParams, chat_template_kwargs=None, tenant: str | None = None):
        prompt_ids, max_tokens = await asyncio.to_thread(self._prepare, messages, params, chat_template_kwargs)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def emit(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed (service shutting down): nobody is listening
                stop.set()

        def work() -> None:
            try:
                gen = self._generate_locked(prompt_ids, params, max_tokens, emit=emit, stop=stop, tenant=tenant)
                if gen is not None:
                    emit(gen)
            except BaseException as exc:  # handed to the consumer, raised there
                emit(exc)
            finally:
                emit(_END)

        thread = threading.Thread(target=work, name="claas-hf-stream", daemon=True)
        thread.start()
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # a consumer that leaves early (client disconnect) ends the generation at the next token

    async def load_adapter(self, path, version=None, probe=None) -> int:
        def work():
            with self._lock:
                new = next_version(self._version, version)
                self._load_adapter_locked(str(path), new, probe)
                return new

        return await asyncio.to_thread(work)

    # ------------------------------------------------------------------ internals (called with the lock held)
    def _serve_locked(self, tenant: str | None):
        """``(policy version, model name, context around the forward passes)`` of one request of ``tenant``. This
        backend serves one adapter to everyone (``tenant`` None); ``TenantHFBackend`` serves one per tenant."""
        if tenant is not None:
            raise ValueError(f"this backend serves one adapter to every key; tenant {tenant!r} needs a TenantHFBackend")
        return self._version, self.served_model, contextlib.nullcontext()

    def _generate_locked(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                         emit: Callable[[object], None] | None = None,
                         stop: threading.Event | None = None, tenant: str | None = None) -> Generation | None:
        """Sample one response; with ``emit``, also hand a StreamStart and one TokenDelta per token to it as they are
        sampled. Returns None if ``stop`` was set before the end (the partial response is not a Generation)."""
        with self._lock:
            version, model_name, scope = self._serve_locked(tenant)
            with scope:
                return self._sample_locked(prompt_ids, params, max_tokens, emit, stop, version, model_name)

    def _sample_locked(self, prompt_ids, params, max_tokens, emit, stop, version, model_name) -> Generation | None:
        """The generation loop (the lock held, the request's adapter selected)."""
        torch = self._torch
        detok = None
        if emit is not None:
            emit(StreamStart(policy_version=version, model=model_name))
            detok = IncrementalDetokenizer(self.tokenizer)
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(int(params.seed))
        tokens: list[int] = []
        logps: list[float] = []
        finish = "length"
        with torch.no_grad():
            input_ids = torch.tensor([prompt_ids], dtype=torch.long)
            past = None
            for _ in range(max_tokens):
                if stop is not None and stop.is_set():
                    self.stopped_early += 1
                    return None
                out = self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token, logp = self._sample(out.logits[:, -1, :], params.temperature, params.top_k,
                                           params.top_p, generator)
                tokens.append(int(token))
                logps.append(float(logp))
                if detok is not None:
                    emit(TokenDelta(text=detok.push([tokens[-1]]), token_ids=(tokens[-1],),
                                    logprobs=(logps[-1],)))
                if int(token) in self.eos_token_ids:
                    finish = "stop"  # the EOS token stays in the response: it carries mask 1 (docs/math.md §0)
                    break
                input_ids = token[:, None]
        if detok is None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        else:
            rest, text = detok.finish()
            if rest:
                emit(TokenDelta(text=rest, token_ids=(), logprobs=()))
        return Generation(prompt_ids=list(prompt_ids), response_ids=tokens, token_logprobs=logps, text=text,
                          finish_reason=finish, policy_version=version, model=model_name)

    def _load_adapter_locked(self, path: str, version: int, probe=None) -> None:
        from peft import PeftModel

        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"lora_path {path!r} is not a peft adapter directory (no adapter_config.json)")
        from claas_verl.claas.tenants.adapters import adapter_file_digest

        digest = adapter_file_digest(path) if os.path.isfile(os.path.join(path, "adapter_model.safetensors")) \
            else None
        name = f"v{version}"
        first = self._adapter is None
        if first:
            self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
        else:
            self.model.load_adapter(path, adapter_name=name)
            self.model.set_adapter(name)
            self.model.eval()
        if probe is not None:
            self._verify_locked(name, first, probe)
        if not first:
            self.model.delete_adapter(self._adapter)  # only the served adapter is kept: no memory growth
        self._adapter = name
        self._version = version
        self._digest = digest

    def _verify_locked(self, name: str, first: bool, probe) -> None:
        """Score ``probe.ids`` with the just-loaded adapter ``name``; drop it (the previous adapter, or the base
        model, is served again) unless ``probe.accept`` takes the scores."""
        from claas_verl.claas.tenants.verify import probe_token_logprobs

        try:
            accepted = probe.accept(probe_token_logprobs(self.model, probe.ids))
        except BaseException:
            self._drop_locked(name, first)
            raise
        if not accepted:
            self._drop_locked(name, first)
            raise AdapterRejected(f"the adapter loaded as {name} failed the serving probe; "
                                  f"still serving {self.served_model} (policy version {self._version})")

    def _drop_locked(self, name: str, first: bool) -> None:
        if first:
            self.model = self.model.unload().eval()  # the base model again, its LoRA layers removed
        else:
            self.model.set_adapter(self._adapter)
            self.model.delete_adapter(name)
            self.model.eval()
