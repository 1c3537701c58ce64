"""One model forward -> every alignment signal (docs/math.md §B.3-B.5), the same code for student and teacher.

Student: call under autograd; the returned rows/states stay in the graph of the same forward whose
logits feed the token loss. Teacher: call under ``torch.no_grad()`` and keep ``.as_targets()``
(detached, bf16), which is what the teacher sends to the actor.

A forward that serves the alignment terms only (the MOPD trainer's separate alignment passes and its teacher
target forward) passes ``logits=False``: the causal-LM head then projects no position (HF ``logits_to_keep``
with an empty index), so no ``[B, T, V]`` logits tensor is built (about 20 GB in bf16 at 64k tokens and
V = 151,936); the decoder body, its hidden states and the captured q/k/v are unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from claas_verl.align.capture import AttentionCapture, attention_modules
from claas_verl.align.hidden_term import hidden_alignment_loss, window_states
from claas_verl.align.pooled_attention import DEFAULT_CHUNK, PooledRows, pooled_attention_rows
from claas_verl.align.regions import StepRegions
from claas_verl.align.sats import default_sats_layers, pooled_rows_loss
from claas_verl.align.targets import TermValue, to_bf16_target

TERMS = ("sats", "vr", "hidden")


@dataclass
class AlignmentSignals:
    """Per layer: SATS rows ``[B,H,R,Tk]``, VR rows ``[B,G,R,Tk]``, window hidden states ``[N_W, D]``."""

    sats: dict[int, PooledRows] = field(default_factory=dict)
    vr: dict[int, PooledRows] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def as_targets(self) -> AlignmentSignals:
        """Detached bf16 copy: the teacher's targets (docs/math.md §B.1 precision)."""
        return AlignmentSignals(
            sats={k: PooledRows(to_bf16_target(v.rows), v.key_start) for k, v in self.sats.items()},
            vr={k: PooledRows(to_bf16_target(v.rows), v.key_start) for k, v in self.vr.items()},
            hidden={k: to_bf16_target(v) for k, v in self.hidden.items()},
        )


def alignment_signals(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    regions: StepRegions,
    *,
    position_ids: torch.Tensor | None = None,
    terms: Iterable[str] = TERMS,
    pooled_layers: Iterable[int] | None = None,
    hidden_layers: Iterable[int] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    recompute: bool = True,
    logits: bool = True,
    **model_kwargs,
):
    """Run ``model`` once and compute the requested signals.

    Args:
        input_ids, attention_mask: ``[B, T]`` prompt+response (left-padded prompt, right-padded response).
        regions: :class:`StepRegions` in sequence coordinates (``step_regions(...).pad_left(prompt_len)``).
        position_ids: ``[B, T]``; pass the same ones as the rollout (verl: cumsum of the mask − 1).
        terms: subset of ``("sats", "vr", "hidden")``.
        pooled_layers: 0-based layers ``L`` for SATS/VR; default :func:`default_sats_layers`.
        hidden_layers: 0-based layers ``L_h``; default all (HF ``hidden_states[l+1]``).
        recompute: recompute each aligned layer's post-RoPE q/k and each query chunk of the pooled rows in the
            backward pass (memory linear in W, needed at W=2000 with long prompts); ``False`` keeps them for the
            backward, about 30% faster where the [W, S] attention rows fit in memory.
        logits: ``False`` keeps no logits (``model_output.logits`` is ``[B, 0, V]``): for forwards whose only
            consumers are the alignment terms. Needs a causal LM whose forward takes ``logits_to_keep`` (HF
            Llama/Qwen2/Qwen3/Mistral).

    Returns:
        ``(model_output, AlignmentSignals)``.
    """
    terms = set(terms)
    if not terms <= set(TERMS):
        raise ValueError(f"terms={sorted(terms)} must be a subset of {TERMS}")
    if regions.region_ids.shape != input_ids.shape:
        raise ValueError(
            f"regions are {tuple(regions.region_ids.shape)} but input_ids {tuple(input_ids.shape)}; "
            "use StepRegions.pad_left(prompt_length)"
        )
    n_layers = len(attention_modules(model))
    pooled = sorted(set(default_sats_layers(n_layers) if pooled_layers is None else pooled_layers))
    hidden = sorted(set(range(n_layers) if hidden_layers is None else hidden_layers))
    want_pooled = bool(terms & {"sats", "vr"})
    if not logits:
        model_kwargs["logits_to_keep"] = _no_positions(model, input_ids.device)
    # a pooled-only student pass without logits: the last layer's output feeds no loss, so its checkpointed
    # recomputation would keep its MLP tensors (never consumed) to the end of the backward; a zero gradient on
    # the model's last hidden state lets the backward consume them (see _ZeroGradLink)
    link_top = want_pooled and not logits and "hidden" not in terms and torch.is_grad_enabled()
    cap = AttentionCapture(model, pooled if want_pooled else [])
    with cap:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states="hidden" in terms or link_top,
            **model_kwargs,
        )
    sig = AlignmentSignals()
    if want_pooled:
        # one layer at a time, checkpointed when autograd records: the q/k norms, RoPE and the gathered window
        # queries of a layer are recomputed in its backward instead of being kept for every aligned layer
        # (fp32 and bf16 copies of q and k: about 19 GiB at 8B and 18k tokens)
        ckpt = recompute and torch.is_grad_enabled()
        for layer in pooled:
            args = (cap, layer, terms, attention_mask, regions, chunk_size, recompute)
            rows = (checkpoint(_layer_rows, *args, use_reentrant=False, preserve_rng_state=False) if ckpt
                    else _layer_rows(*args))
            for name, value in rows.items():
                getattr(sig, name)[layer] = value
        if link_top and out.hidden_states[-1].requires_grad:
            name = "sats" if "sats" in terms else "vr"
            first = getattr(sig, name)[pooled[0]]
            getattr(sig, name)[pooled[0]] = PooledRows(_ZeroGradLink.apply(first.rows, out.hidden_states[-1]),
                                                       first.key_start)
    if "hidden" in terms:
        if any(not 0 <= layer < n_layers for layer in hidden):
            raise ValueError(f"hidden_layers {hidden} out of range for {n_layers} layers")
        for layer in hidden:
            sig.hidden[layer] = window_states(out.hidden_states[layer + 1], regions.window_mask)
    return out, sig


class _ZeroGradLink(torch.autograd.Function):
    """``rows`` unchanged; in the backward, a zero gradient (an expanded scalar: no allocation) for ``hidden``.

    Values and gradients of every parameter are unchanged (zeros are added); the top decoder layer's backward then
    runs, consuming its recomputed activations, and FSDP2's pre-backward hook of that layer fires as usual."""

    @staticmethod
    def forward(ctx, rows, hidden):
        ctx.hidden_meta = (hidden.shape, hidden.dtype, hidden.device)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.hidden_meta
        return grad, torch.zeros((), dtype=dtype, device=device).expand(shape)


def _layer_rows(cap: AttentionCapture, layer: int, terms: set[str], attention_mask: torch.Tensor,
                regions: StepRegions, chunk_size: int, recompute: bool) -> dict[str, PooledRows]:
    """SATS and/or VR rows of one captured layer (post-RoPE q/k from the capture's raw projections)."""
    qkv = cap.result([layer])
    rid, num = regions.region_ids, regions.num_regions
    out = {}
    if "sats" in terms:
        out["sats"] = pooled_attention_rows(qkv.queries[layer], qkv.keys[layer], attention_mask, rid, num,
                                            chunk_size=chunk_size, recompute=recompute)
    if "vr" in terms:
        v = qkv.values[layer]
        out["vr"] = pooled_attention_rows(v, v, attention_mask, rid, num, chunk_size=chunk_size, recompute=recompute)
    return out


def _no_positions(model: nn.Module, device) -> torch.Tensor:
    """``logits_to_keep`` that selects no position: the LM head runs on ``[B, 0, D]`` and returns ``[B, 0, V]``."""
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        raise ValueError(
            f"logits=False needs a causal LM whose forward takes logits_to_keep (HF Llama/Qwen2/Qwen3 family); "
            f"{type(model).__name__} does not: pass logits=True"
        )
    return torch.empty(0, dtype=torch.long, device=device)


def alignment_losses(
    student: AlignmentSignals, teacher: AlignmentSignals, regions: StepRegions
) -> dict[str, TermValue]:
    """ℓ_SATS, ℓ_VR, ℓ_hid of one micro-batch for every term present in ``student`` (docs/math.md §B.3-B.5, B.7)."""
    out = {}
    for name in ("sats", "vr"):
        s, t = getattr(student, name), getattr(teacher, name)
        if s:
            if set(s) != set(t):
                raise ValueError(f"{name}: student layers {sorted(s)} != teacher layers {sorted(t)}")
            out[name] = pooled_rows_loss([s[k] for k in sorted(s)], [t[k] for k in sorted(s)], regions.num_regions)
    if student.hidden:
        if set(student.hidden) != set(teacher.hidden):
            raise ValueError(f"hidden: student layers {sorted(student.hidden)} != teacher {sorted(teacher.hidden)}")
        keys = sorted(student.hidden)
        out["hidden"] = hidden_alignment_loss(
            [student.hidden[k] for k in keys], [teacher.hidden[k] for k in keys], regions.window_mask
        )
    return out
