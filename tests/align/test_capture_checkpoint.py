"""The alignment forward recomputes each aligned layer's q/k norms, RoPE and window queries in its backward.

Gradients are bit-identical to the forward that keeps them (the recomputation replays the same operators), and
after the forward only the captured raw projections, the checkpointed layer inputs and the pooled rows stay
alive (the fp32 and bf16 copies of q and k of every aligned layer used to: about 19 GiB at 8B, 18k tokens).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from claas_verl.align import alignment_losses, alignment_signals, signals, step_regions
from claas_verl.utils.live_bytes import LiveBytes

B, T, P, W, D, H, G, HD, L = 2, 160, 16, 96, 128, 4, 2, 32, 3


def _model(dtype, checkpointing=True):
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=D, intermediate_size=256, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=G, head_dim=HD, vocab_size=256, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).to(dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch():
    ids = torch.randint(10, 256, (B, T), generator=torch.Generator().manual_seed(1))
    ids[:, P + 5::9] = 7
    am = torch.ones_like(ids)
    return ids, am, step_regions(ids[:, P:], am[:, P:], {7}, window=W).pad_left(P)


def _pass(model, targets, recompute=True, logits=False):
    ids, am, reg = _batch()
    with LiveBytes() as mem:
        _, sig = alignment_signals(model, ids, am, reg, terms=["sats", "vr"], pooled_layers=range(L),
                                   logits=logits, use_cache=False, recompute=recompute)
        after_forward = mem.now
        losses = alignment_losses(sig, targets, reg)
        (losses["sats"].loss + losses["vr"].loss).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return grads, after_forward, sig


def _targets(model):
    ids, am, reg = _batch()
    with torch.no_grad():
        _, sig = alignment_signals(model, ids, am, reg, terms=["sats", "vr"], pooled_layers=range(L), logits=False)
    targets = sig.as_targets()
    for rows in (*targets.sats.values(), *targets.vr.values()):
        rows.rows.mul_(1.1)  # a teacher that differs from the student
    return targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_capture_gives_bit_identical_gradients(dtype):
    """Against plain autograd (no checkpointing anywhere, everything kept): the same bits; parameters the
    pooled terms do not reach (the last layer's MLP, the final norm) get exact zeros instead of no gradient."""
    model = _model(dtype, checkpointing=False)
    targets = _targets(model)
    kept, _, _ = _pass(model, targets, recompute=False, logits=True)
    model = _model(dtype)
    recomputed, _, _ = _pass(model, targets)
    reached = [i for i, g in enumerate(kept) if g is not None]
    assert len(reached) > 20 and len(recomputed) == len(kept)
    for a, b in zip(kept, recomputed):
        if a is None:
            assert b is None or (b == 0).all()
        else:
            assert torch.equal(a, b)


def test_only_raw_projections_layer_inputs_and_rows_outlive_the_forward():
    model = _model(torch.float32)
    _, after_forward, sig = _pass(model, _targets(model))
    raw = 4 * B * T * (H + 2 * G) * HD * L  # q_proj, k_proj, v_proj outputs of every aligned layer
    layer_inputs = 4 * B * T * D * L  # the checkpointed decoder layers' inputs
    rows = sum(r.rows.nbytes for r in (*sig.sats.values(), *sig.vr.values()))
    final_norm = 4 * 4 * B * T * D  # the last hidden state and the final norm's saved tensors
    # kept post-RoPE/normed q and k (what the forward held before) would add 2 * 4 * B * T * (H + G) * HD * L
    assert after_forward <= raw + layer_inputs + rows + final_norm


def test_the_last_layer_recomputation_does_not_outlive_its_backward(monkeypatch):
    """A SATS pass without logits: the last decoder layer's output feeds no loss. Its checkpointed recomputation
    kept that layer's MLP activations (never consumed) for the rest of the backward, so the peak held two
    recomputed layers; the zero-gradient link lets the backward consume them."""
    model = _model(torch.bfloat16)
    targets = _targets(model)
    ids, am, reg = _batch()

    def peak():
        with LiveBytes() as mem:
            _, sig = alignment_signals(model, ids, am, reg, terms=["sats"], pooled_layers=range(L), logits=False,
                                       use_cache=False)
            alignment_losses(sig, targets, reg)["sats"].loss.backward()
        return mem.peak

    linked = peak()
    monkeypatch.setattr(signals._ZeroGradLink, "apply", lambda rows, hidden: rows)  # no link
    unlinked = peak()
    mlp_of_one_layer = 2 * 4 * B * T * model.config.intermediate_size  # gate, act, up, product (bf16)
    assert linked < unlinked - mlp_of_one_layer / 2
