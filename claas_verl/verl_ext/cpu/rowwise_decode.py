"""Decoding several replies of one prompt together, with the bits each gets decoded alone.

A one-token decode step of ``n`` rows runs every linear layer as one ``[n, h] @ [h, o]`` matrix product, and a BLAS
picks its kernel by the product's shape: the rows come out rounded differently from the ``[1, h] @ [h, o]`` product
of a reply decoded on its own (the last bits of the logits move, and with them the log-probs, and now and then a
sampled token). Within :func:`rowwise_linears` a linear layer given a ``[n, 1, h]`` decode input computes it as one
batched product of ``n`` separate ``[1, h] @ [h, o]`` products (``bmm`` / ``baddbmm``), the shapes of a lone
decode, where that rounds each row as the lone product does (probed once per layer shape; on this project's CPU
torch it does not for a LoRA rank of 2), and otherwise through ``n`` lone calls. The other operators of a decoder
layer (norms, rotary embeddings, attention over equal-length caches, activations) treat each row on its own
whatever the batch.

That this yields *exactly* the lone values is a property of one machine's kernels, not a guarantee of torch, so
:func:`rowwise_decode_matches` checks it on the served model before it is relied on (the ``hf`` rollout server
decodes each reply alone when it does not hold).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

# the check: this many rows, fed these many fixed tokens after the prompt's prefill
_CHECK_ROWS = 3
_CHECK_STEPS = 3


def _batched_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[n, 1, h]`` rows times ``weight.T`` as one batched product of ``n`` one-row products."""
    n = x.shape[0]
    weight_t = weight.t().expand(n, -1, -1)
    return torch.bmm(x, weight_t) if bias is None else torch.baddbmm(bias.expand(n, 1, -1), x, weight_t)


def _row_by_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[n, 1, h]`` rows each through the very call a lone decode makes."""
    return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])


# (in, out, bias, dtype) -> whether the batched product rounds each row as its lone product does. BLAS libraries
# choose kernels by shape: one-row products of a small inner or outer size (a LoRA rank, say) can take another
# path when batched, so every layer shape is probed once per process, and falls back to one call per row.
_BATCHED_EXACT: dict[tuple, bool] = {}


def _batched_is_exact(h: int, o: int, bias: bool, dtype: torch.dtype) -> bool:
    key = (h, o, bias, dtype)
    if key not in _BATCHED_EXACT:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(o, h, generator=g).to(dtype)
        b = torch.randn(o, generator=g).to(dtype) if bias else None
        x = torch.randn(_CHECK_ROWS, 1, h, generator=g).to(dtype)
        _BATCHED_EXACT[key] = torch.equal(_batched_rows(x, w, b), _row_by_row(x, w, b))
    return _BATCHED_EXACT[key]


def _rowwise_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; a ``[n, 1, h]`` input with ``n > 1`` as ``n`` products of one row each."""
    if x.dim() != 3 or x.shape[0] == 1 or x.shape[1] != 1:
        return F.linear(x, layer.weight, layer.bias)
    w, b = layer.weight, layer.bias
    if _batched_is_exact(w.shape[1], w.shape[0], b is not None, w.dtype):
        return _batched_rows(x, w, b)
    return _row_by_row(x, w, b)


@contextlib.contextmanager
def rowwise_linears(model: nn.Module) -> Iterator[None]:
    """Within the block, every ``nn.Linear`` of ``model`` (a LoRA adapter's too) computes decode inputs row by row.

    The layers' parameters are untouched (an instance-level ``forward`` is set and removed again), so a weight
    update between two blocks reaches both paths.
    """
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        for layer in layers:
            layer.forward = partial(_rowwise_linear, layer)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


@torch.inference_mode()
def rowwise_decode_matches(model: nn.Module, past: object, vocab: int) -> bool:
    """Whether decoding ``_CHECK_ROWS`` rows together under :func:`rowwise_linears` gives each row's logits bit for
    bit as decoding it alone, on ``model`` from ``past`` (a prompt's prefill cache, left unchanged).

    Every row is fed its own fixed tokens (ids below ``vocab``, different for every row and step) for
    ``_CHECK_STEPS`` steps, so rows differ as sampled replies do.
    """
    feeds = [[(1 + row + 7 * step) % vocab for step in range(_CHECK_STEPS)] for row in range(_CHECK_ROWS)]
    alone = []
    for tokens in feeds:
        cache, logits = copy.deepcopy(past), []
        for t in tokens:
            out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[:, -1, :])
        alone.append(logits)
    cache = copy.deepcopy(past)
    cache.batch_repeat_interleave(_CHECK_ROWS)
    with rowwise_linears(model):
        for step in range(_CHECK_STEPS):
            ids = torch.tensor([[tokens[step]] for tokens in feeds])
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            if not all(torch.equal(out.logits[row, -1:, :], alone[row][step]) for row in range(_CHECK_ROWS)):
                return False
    return True
