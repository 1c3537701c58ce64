"""Capture post-RoPE queries/keys and values of chosen layers from HF Qwen2/Llama-family models.

No transformers code is edited. Forward hooks record the outputs of ``q_proj``, ``k_proj`` and
``v_proj`` (LoRA wrappers included, since the hook sees the wrapper's output) and a pre-hook on
``self_attn`` records the ``position_embeddings`` (cos, sin) the model passes to it. Where the
attention module has per-head ``q_norm``/``k_norm`` modules (Qwen3), the queries and keys are taken
from the outputs of those modules instead: the norms then run inside the layer's own forward, with
the layer's own (gathered) weights. Applying them after the forward would read weights that FSDP2
has resharded by then (DTensor shards, not the tensors the forward used). After the forward,
:meth:`AttentionCapture.result` reshapes to heads and applies the model's rotary embedding with the
rotate-half rule shared by Llama, Qwen2, Qwen3 and Mistral. Values get no RoPE (docs/math.md §B.5).

The hooks only *store* tensors the model computed anyway; the RoPE math happens after the forward,
outside any gradient-checkpointed layer, so the result keeps autograd on the student side and costs
nothing extra under ``torch.no_grad()`` on the teacher side.

Usage::

    with AttentionCapture(model, layers=[6, 13, 20, 27]) as cap:
        out = model(input_ids=ids, attention_mask=am, position_ids=pos, output_hidden_states=True)
    qkv = cap.result()          # exit the context before backward()
    q, k, v = qkv.queries[6], qkv.keys[6], qkv.values[6]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class CapturedQKV:
    """Per layer index: ``queries [B, H, T, d]`` and ``keys [B, G, T, d]`` after RoPE, ``values [B, G, T, d]``."""

    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's self-attention modules in layer order (modules with q/k/v_proj and ``layer_idx``)."""
    found = {}
    for mod in model.modules():
        if all(hasattr(mod, n) for n in ("q_proj", "k_proj", "v_proj", "layer_idx")):
            found.setdefault(int(mod.layer_idx), mod)
    if not found:
        raise ValueError("model has no attention modules with q_proj/k_proj/v_proj/layer_idx (HF Llama/Qwen2 family)")
    return [found[i] for i in sorted(found)]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, heads, T, d]``, ``cos/sin [B, T, d]``: ``x·cos + rotate_half(x)·sin`` (HF rotate-half RoPE)."""
    if cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"rotary dim {cos.shape[-1]} != head_dim {x.shape[-1]}: partial RoPE is not supported")
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class AttentionCapture:
    """Context manager that records q/k/v of ``layers`` (0-based decoder indices) during one forward."""

    def __init__(self, model: nn.Module, layers: Iterable[int]):
        mods = attention_modules(model)
        self.layers = sorted({int(layer) for layer in layers})
        bad = [layer for layer in self.layers if not 0 <= layer < len(mods)]
        if bad:
            raise ValueError(f"layers {bad} out of range for a model with {len(mods)} decoder layers")
        self._mods = {layer: mods[layer] for layer in self.layers}
        self._raw: dict[int, dict[str, object]] = {}
        self._handles: list = []

    def __enter__(self) -> AttentionCapture:
        self._raw = {layer: {} for layer in self.layers}
        for layer, mod in self._mods.items():
            store = self._raw[layer]
            self._handles.append(mod.register_forward_pre_hook(_pre_hook(store), with_kwargs=True))
            for name, source in _sources(mod).items():
                self._handles.append(getattr(mod, source).register_forward_hook(_out_hook(store, name)))
        return self

    def __exit__(self, *exc) -> None:
        for hnd in self._handles:
            hnd.remove()
        self._handles = []

    def result(self, layers: Iterable[int] | None = None) -> CapturedQKV:
        """Heads-first q/k (post-RoPE) and v of ``layers`` (default: every captured layer); dtype as the model ran."""
        out = CapturedQKV()
        for layer in self.layers if layers is None else layers:
            mod = self._mods[layer]
            raw = self._raw.get(layer, {})
            missing = [f"{n} ({s})" for n, s in _sources(mod).items() if n not in raw]
            if missing or "pos" not in raw:
                raise ValueError(f"layer {layer} was not captured ({missing or 'position_embeddings'} never ran): "
                                 "run exactly one model forward inside the context")
            d = mod.head_dim
            q, k, v = (_heads(raw[n], d) for n in ("q", "k", "v"))
            cos, sin = raw["pos"]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out.queries[layer] = apply_rope(q, cos, sin)
            out.keys[layer] = apply_rope(k, cos, sin)
            out.values[layer] = v
        return out


def _sources(mod: nn.Module) -> dict[str, str]:
    """Which submodule's output is q, k and v: the per-head norms where the model has them (Qwen3 normalises
    q and k per head before RoPE), the projections otherwise."""
    has_norms = getattr(mod, "q_norm", None) is not None and getattr(mod, "k_norm", None) is not None
    return {"q": "q_norm" if has_norms else "q_proj", "k": "k_norm" if has_norms else "k_proj", "v": "v_proj"}


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, T, heads, d]``: a projection output ``[B, T, heads·d]`` split into heads (a norm output already is)."""
    return x if x.dim() == 4 else x.unflatten(-1, (-1, head_dim))


def _pre_hook(store):
    def hook(module, args, kwargs):
        pe = kwargs.get("position_embeddings")
        if pe is None and len(args) > 1:
            pe = args[1]
        if pe is None:
            raise ValueError("attention module was called without position_embeddings; unsupported model family")
        store["pos"] = pe

    return hook


def _out_hook(store, name):
    def hook(module, args, output):
        store[name] = output

    return hook
