"""Decoding for the ``hf`` rollout: prefill and batched token-by-token sampling with a Hugging Face causal LM.

Pure torch over a ``transformers`` model; :class:`~claas_verl.verl_ext.cpu.hf_rollout.HFRolloutServer` decides
which requests decode together and holds the model. Every row samples from its own generator, so a reply does not
depend on which other requests share its batch (its logits do, to the rounding of a batched matmul).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from claas_verl.utils.generation import sample_next_token


@dataclass(frozen=True)
class DecodeRequest:
    """One generate call, its sampling parameters resolved."""

    prompt_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    stop_ids: frozenset[int]
    max_tokens: int


@dataclass
class Decoded:
    """The sampled reply of one request and the log-prob of each token under the sampling distribution."""

    tokens: list[int]
    log_probs: list[float]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# inference_mode rather than no_grad: the same kernels and values (no autograd either way), less per-operator
# bookkeeping, which is most of a small model's decode step on CPU
@torch.inference_mode()
def prefill(model, prompt_ids: list[int]) -> tuple[Any, torch.Tensor]:
    """A lone request's first forward: its KV cache and next-token logits ``[1, V]``."""
    out = model(input_ids=torch.tensor([prompt_ids], dtype=torch.long), use_cache=True)
    return out.past_key_values, out.logits[:, -1, :]


@torch.inference_mode()
def decode_batch(model, requests: list[DecodeRequest], generators: list[torch.Generator],
                 prefilled: tuple[Any, torch.Tensor] | None = None) -> list[Decoded]:
    """Decode ``requests`` together: one forward per token position for all unfinished rows.

    Every row samples from its own generator (one draw per token, as a request decoded alone would), so a
    request's tokens do not depend on which others share its batch; its logits do only to the rounding of
    a batched matmul. Prompts of unequal length are left-padded: the pads are masked out of attention and
    the position ids count real tokens only. A row leaves the batch (and its KV cache) when it samples a
    stop token or reaches its ``max_tokens``.

    ``prefilled``: a lone request's :func:`prefill` of the prompt all ``requests`` share, used (copied, one row
    per request) in place of their first forward.
    """
    if prefilled is not None and any(r.prompt_ids != requests[0].prompt_ids for r in requests):
        raise ValueError("a shared prefill serves the requests of its own prompt only, got different prompts")
    lengths = torch.tensor([len(r.prompt_ids) for r in requests])
    width = int(lengths.max())
    input_ids = torch.zeros((len(requests), width), dtype=torch.long)  # pad id 0: masked, never attended
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
    # Equal lengths need no mask: the call is then exactly a lone request's (HF infers the positions).
    mask = None
    if int(lengths.min()) != width:
        mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    done = [Decoded([], []) for _ in requests]
    rows = list(range(len(requests)))  # request index of each batch row
    past = None
    while rows:
        if prefilled is not None and past is None:
            past, last = copy.deepcopy(prefilled[0]), prefilled[1].expand(len(requests), -1)
            if len(requests) > 1:
                past.batch_repeat_interleave(len(requests))
        else:
            extra = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True, **extra)
            past, last = out.past_key_values, out.logits[:, -1, :]
        keep, next_ids = [], []
        for b, i in enumerate(rows):
            r = requests[i]
            token, logp = sample_next_token(last[b : b + 1], r.temperature, r.top_k, r.top_p, generators[i])
            t = int(token)
            done[i].tokens.append(t)
            done[i].log_probs.append(float(logp))
            if t not in r.stop_ids and len(done[i].tokens) < r.max_tokens:
                keep.append(b)
                next_ids.append(t)
        if not keep:
            break
        if len(keep) < len(rows):
            index = torch.tensor(keep)
            past.batch_select_indices(index)
            if mask is not None:
                mask, positions = mask[index], positions[index]
        rows = [rows[b] for b in keep]
        input_ids = torch.tensor(next_ids, dtype=torch.long)[:, None]
        if mask is not None:
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=-1)
            positions = positions[:, -1:] + 1
    return done
