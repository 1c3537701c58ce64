"""A Hugging Face transformers rollout for verl: the CPU stand-in for vLLM/SGLang.

Three pieces, mirroring verl's own vLLM rollout:

* ``HFRolloutServer`` (this module): a Ray actor holding an HF causal LM. ``generate`` is verl's
  token-in/token-out call (returns ``TokenOutput``); ``update_weights`` receives the trainer's tensors (or a peft
  LoRA adapter) after every update and bumps ``policy_version``; the control methods that ``RolloutReplica`` and
  the checkpoint manager call (sleep, wake_up, KV-cache ones, abort/resume, profile) are no-ops because there is
  no accelerator memory to free. The decoding itself is in :mod:`claas_verl.verl_ext.cpu.hf_decode`.
* ``HFReplica`` and ``HFServerAdapter`` (:mod:`claas_verl.verl_ext.cpu.hf_replica`): verl's side, the replica
  that launches one server per replica and the adapter that streams each trainer worker's weights to it.

Select it with ``actor_rollout_ref.rollout.name=hf`` (the CPU preset does).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import os
from collections import deque
from typing import Any

import torch

from claas_verl.utils.generation import eos_token_ids
from claas_verl.verl_ext.cpu import hf_decode
from claas_verl.verl_ext.cpu.checks import check_model_path
from claas_verl.verl_ext.cpu.hf_decode import Decoded, DecodeRequest, mix_seed
from claas_verl.verl_ext.cpu.rowwise_decode import rowwise_decode_matches, rowwise_linears

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"

# Batching: how long the decoder waits for more requests while they keep arriving, and at most.
_GATHER_S = 0.002
_GATHER_MAX_S = 0.02
_BATCH_HISTORY = 4096


def hf_max_batch_size(config) -> int:
    """Rows per decoded batch: ``rollout.engine_kwargs.hf.max_batch_size``, 1 (each request alone) when unset.

    1 keeps a run exactly repeatable: a request's logits then never depend on which requests share its batch, and
    which do depends on arrival timing. A batch is many times faster when replies are long (docs/verl-couplings.md),
    at the price of rounding-level differences between runs (rarely a different token).
    """
    hf = (getattr(config, "engine_kwargs", None) or {}).get("hf") or {}
    value = hf.get("max_batch_size", 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_kwargs.hf.max_batch_size must be an integer >= 1, got {value!r}; "
            "1 decodes each request alone (exactly repeatable), more batches concurrent requests"
        )
    return value


def as_peft_config(peft_config: Any):
    """A peft ``PeftConfig`` from what the trainer sends.

    verl's FSDP engine ships ``peft_config.to_dict()`` (a plain dict, picklable across Ray), while in-process
    callers may pass the ``LoraConfig`` itself.
    """
    if isinstance(peft_config, dict) or (hasattr(peft_config, "keys") and not hasattr(peft_config, "peft_type")):
        from peft import get_peft_config

        cfg = dict(peft_config)
        if "peft_type" not in cfg:
            raise ValueError(f"peft_config dict has no 'peft_type' (keys: {sorted(cfg)[:8]}); cannot build an adapter")
        return get_peft_config(cfg)
    return peft_config


def _strip_base_layer(name: str) -> str:
    # verl names base weights of a LoRA-wrapped trainer "<module>.base_layer.weight" when it
    # syncs the base model; a plain HF model calls them "<module>.weight".
    return name.replace(".base_layer.", ".")


class HFRolloutServer:
    """Token-in/token-out generation with an HF model; wrapped with ``ray.remote`` by ``HFReplica``.

    ``policy_version`` counts completed weight updates (0 = the weights loaded from
    ``model.path``); every ``TokenOutput`` carries it in ``extra_fields["policy_version"]``.
    """

    def __init__(self, config, model_config, replica_rank: int = 0, node_rank: int = 0):
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass

        torch.set_num_threads(max(1, int(os.environ.get("CLAAS_ROLLOUT_THREADS", "1"))))
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        path = self.model_config.local_path
        check_model_path(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.float32,
            attn_implementation="sdpa",
            trust_remote_code=self.model_config.trust_remote_code,
        ).eval()
        self.eos_token_ids = self._eos_token_ids()
        self.generator = torch.Generator().manual_seed(int(getattr(self.config, "seed", 0)) + replica_rank)
        self.policy_version = 0
        self.global_steps: int | None = None
        self._lock = asyncio.Lock()  # one decode at a time: updates never interleave with a decode
        self._queue: list[tuple[DecodeRequest, asyncio.Future]] = []
        self._decoder: asyncio.Task | None = None
        self._max_batch = hf_max_batch_size(self.config)
        # rows of the latest decoded batches, in order (diagnostics and tests); bounded for a long-lived server
        self.batch_sizes: deque[int] = deque(maxlen=_BATCH_HISTORY)
        self._pending: dict[str, torch.Tensor] = {}
        self._peft_applied = False
        # whether a prompt's queued replies can be decoded as one batch with the bits each gets alone
        # (rowwise_decode_matches); checked on the served model at its first use, again once peft wraps it
        self._siblings_together: bool | None = None
        # Names of the tensors applied by the latest weight update and how it was applied ("full" or
        # "lora"): lets tests prove that only the adapter travels after the first sync.
        self.last_update_names: list[str] = []
        self.last_update_kind: str | None = None

    def _eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.model, getattr(self.model_config, "tokenizer", None))

    # ------------------------------------------------------------------ generation
    def _max_tokens(self, n_prompt: int, sampling_params: dict) -> int:
        room = self.config.max_model_len - n_prompt if self.config.max_model_len else 1 << 30
        if "max_tokens" in sampling_params:
            want = int(sampling_params["max_tokens"])
        elif "max_new_tokens" in sampling_params:
            want = int(sampling_params["max_new_tokens"])
        else:
            want = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - n_prompt
            )
        return max(1, min(want, room))

    # ------------------------------------------------------------------ sampling RNG (exact resume)
    def _reseed(self, global_steps: int) -> None:
        """Sampling RNG as a pure function of (seed, replica rank, global step).

        A resumed run regenerates the same responses: the trainer announces step N after loading checkpoint N,
        as after running step N.
        """
        self._step_key = (int(getattr(self.config, "seed", 0)), int(self.replica_rank), int(global_steps))
        self._requests_seen: dict[bytes, int] = {}
        self.generator = torch.Generator().manual_seed(mix_seed(*self._step_key))

    def _request_generator(self, prompt_ids: list[int]) -> torch.Generator:
        """One generator per request, keyed by the prompt and its occurrence in the step.

        Concurrent requests then do not make the samples depend on their arrival order. Call under ``self._lock``.
        """
        if getattr(self, "_step_key", None) is None:
            return self.generator  # before the first weight sync / step announcement
        key = hashlib.sha256(repr(prompt_ids).encode()).digest()[:16]
        k = self._requests_seen.get(key, 0)
        self._requests_seen[key] = k + 1
        return torch.Generator().manual_seed(mix_seed(*self._step_key, int.from_bytes(key, "little"), k))

    def _request(self, prompt_ids: list[int], sampling_params: dict) -> DecodeRequest:
        temperature = float(sampling_params.get("temperature", 1.0))
        top_k = int(sampling_params.get("top_k", -1) or -1)
        top_p = float(sampling_params.get("top_p", 1.0))
        stop_ids = set(self.eos_token_ids) | set(sampling_params.get("stop_token_ids") or [])
        if sampling_params.get("ignore_eos", False):
            stop_ids = set(sampling_params.get("stop_token_ids") or [])
        max_tokens = self._max_tokens(len(prompt_ids), sampling_params)
        return DecodeRequest(prompt_ids, temperature, top_k, top_p, frozenset(stop_ids), max_tokens)

    def _prefill(self, prompt_ids: list[int]) -> tuple[Any, torch.Tensor]:
        """A lone request's first forward with the served model: its KV cache and next-token logits ``[1, V]``."""
        return hf_decode.prefill(self.model, prompt_ids)

    def _decode_siblings(self, requests: list[DecodeRequest], generators: list[torch.Generator]) -> list[Decoded]:
        """Decode requests that share one prompt (verl's ``rollout.n`` replies of a prompt) from one prefill, each
        reply exactly as it is decoded alone.

        A lone request's prefill is the same forward whatever follows it, so one prefill serves them all. The
        replies are then decoded as one batch whose linear layers multiply row by row
        (:mod:`claas_verl.verl_ext.cpu.rowwise_decode`), when the served model gives each row its lone values
        bit for bit (checked once); otherwise one after another, each from a copy of the prefill's KV cache.
        """
        prefill = self._prefill(requests[0].prompt_ids)
        if len(requests) > 1 and self._siblings_decode_together(prefill):
            with rowwise_linears(self.model):
                return self._decode_batch(requests, generators, prefill=prefill)
        return [self._decode_batch([r], [g], prefill=prefill)[0] for r, g in zip(requests, generators, strict=True)]

    def _siblings_decode_together(self, prefill: tuple[Any, torch.Tensor]) -> bool:
        if self._siblings_together is None:
            self._siblings_together = rowwise_decode_matches(self.model, prefill[0], int(prefill[1].shape[-1]))
            if not self._siblings_together:
                logger.info("hf rollout: batched decoding does not reproduce this model's lone replies bit for bit "
                            "on this machine; a prompt's replies are decoded one after another")
        return self._siblings_together

    def _decode_batch(self, requests: list[DecodeRequest], generators: list[torch.Generator],
                      prefill: tuple[Any, torch.Tensor] | None = None) -> list[Decoded]:
        """Decode ``requests`` together with the served model (:func:`hf_decode.decode_batch`)."""
        return hf_decode.decode_batch(self.model, requests, generators, prefill)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        **kwargs: Any,
    ):
        """verl's token-in/token-out call (same signature as vLLM's server ``generate``).

        With ``rollout.engine_kwargs.hf.max_batch_size`` above 1, requests that arrive while others wait or
        decode are decoded together (:meth:`_decode_batch`), up to that many rows a batch.
        """
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None:
            raise ValueError("the 'hf' CPU rollout is text-only; image_data/video_data are not supported")
        request = self._request([int(t) for t in prompt_ids], dict(sampling_params))
        future = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if self._decoder is None or self._decoder.done():
            self._decoder = asyncio.create_task(self._decode_queue())
        decoded, version, steps = await future
        return TokenOutput(
            token_ids=decoded.tokens,
            log_probs=decoded.log_probs if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": steps, "policy_version": version},
        )

    async def _decode_queue(self) -> None:
        """Decode queued requests batch by batch until the queue is empty."""
        while self._queue:
            await self._gather_arrivals()
            async with self._lock:
                alone = self._max_batch == 1
                if alone and getattr(self, "_step_key", None) is not None:
                    # each request is decoded alone; the queued requests with the first one's prompt follow it, in
                    # their arrival order, and share its prefill. The reordering changes no reply: a request's
                    # generator is keyed by its prompt and its occurrence among that prompt's requests (before the
                    # first step announcement all requests draw from one generator, so nothing is reordered)
                    first = self._queue[0][0].prompt_ids
                    batch = [item for item in self._queue if item[0].prompt_ids == first]
                    self._queue = [item for item in self._queue if item[0].prompt_ids != first]
                elif alone:
                    batch, self._queue = self._queue[:1], self._queue[1:]
                else:
                    batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
                # captured when the batch starts: the version that served it from its start (docs/math.md §A.1.1);
                # generators are drawn in arrival order, as one request at a time would draw them
                version, steps = self.policy_version, self.global_steps
                requests = [r for r, _ in batch]
                generators = [self._request_generator(r.prompt_ids) for r in requests]
                try:
                    decode = self._decode_siblings if alone else self._decode_batch
                    decoded = await asyncio.to_thread(decode, requests, generators)
                except Exception as err:  # every waiting caller sees the failure, none hangs
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(err)
                    continue
            together = not alone or (len(batch) > 1 and self._siblings_together)
            self.batch_sizes.extend([len(batch)] if together else [1] * len(batch))
            for (_, future), result in zip(batch, decoded):
                if not future.done():
                    future.set_result((result, version, steps))

    async def _gather_arrivals(self) -> None:
        """Wait briefly while requests keep arriving, so that they share one batch instead of the first decoding alone.

        verl's agent loops send a step's requests over a few milliseconds.
        """
        waited = 0.0
        while len(self._queue) < self._max_batch and waited < _GATHER_MAX_S:
            seen = len(self._queue)
            await asyncio.sleep(_GATHER_S)
            waited += _GATHER_S
            if len(self._queue) == seen:
                return

    # ------------------------------------------------------------------ weight sync
    async def receive_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Buffer one bucket of a weight update; applied atomically by ``finish_weight_update``."""
        for name, tensor in named_tensors:
            self._pending[name] = tensor

    async def finish_weight_update(
        self, peft_config: Any = None, base_sync_done: bool = True, global_steps: int | None = None
    ) -> int:
        """Apply the buffered tensors (full weights, or a LoRA adapter when ``peft_config`` is given)."""
        async with self._lock:
            pending, self._pending = self._pending, {}
            if peft_config is not None and base_sync_done:
                self._apply_lora(pending, peft_config)
                self.last_update_kind = "lora"
            else:
                self._load_full(pending)
                self.last_update_kind = "full"
            self.last_update_names = sorted(pending)
            self.policy_version += 1
            if global_steps is not None:
                self.global_steps = global_steps
                self._reseed(global_steps)
            return self.policy_version

    def _load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        target = self.model.get_base_model() if self._peft_applied else self.model
        own = target.state_dict()
        state = {}
        for name, tensor in tensors.items():
            key = _strip_base_layer(name)
            if key not in own:
                raise KeyError(
                    f"weight sync sent {name!r}, which the rollout model lacks; the trainer and "
                    f"actor_rollout_ref.model.path must name the same architecture"
                )
            state[key] = tensor.to(own[key].dtype)
        target.load_state_dict(state, strict=False)

    def _apply_lora(self, tensors: dict[str, torch.Tensor], peft_config: Any) -> None:
        # A plain load_state_dict(strict=False) would silently drop LoRA tensors and keep
        # sampling from the base model: wrap with peft once, then load the adapter by name.
        from peft import get_peft_model, set_peft_model_state_dict

        if not self._peft_applied:
            self.model = get_peft_model(self.model, as_peft_config(peft_config)).eval()
            self._peft_applied = True
            self._siblings_together = None  # the adapter's layers join the decode: check them too
        result = set_peft_model_state_dict(self.model, {k: v.float() for k, v in tensors.items()})
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise KeyError(f"LoRA sync sent tensors the rollout's peft model does not have: {unexpected[:5]}")

    def get_batch_sizes(self) -> list[int]:
        """Rows of the latest (at most ``_BATCH_HISTORY``) decoded batches, in order."""
        return list(self.batch_sizes)

    def get_policy_version(self) -> int:
        return self.policy_version

    def get_last_update(self) -> dict[str, Any]:
        """``{"kind": "full"|"lora"|None, "names": [...], "version": int}`` of the latest weight update."""
        return {"kind": self.last_update_kind, "names": list(self.last_update_names), "version": self.policy_version}

    def get_named_parameters(self) -> dict[str, torch.Tensor]:
        """The served weights (merged view for LoRA), for tests and debugging."""
        model = self.model
        if self._peft_applied:
            model = copy.deepcopy(self.model).merge_and_unload()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    # ------------------------------------------------------------------ control (no accelerator memory to manage)
    async def wake_up(self, tags: list[str] | None = None):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None  # the KV cache lives only inside one generate call

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True):
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self):
        return None

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps
        self._reseed(global_steps)

    async def wait_for_requests_to_drain(self):
        # the decoder runs until its queue is empty: once it is done, every request that came before has its reply
        while self._decoder is not None and not self._decoder.done():
            await asyncio.shield(self._decoder)
        async with self._lock:  # and no decode is running
            return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None
