"""FSDP2 + gradient checkpointing: the alignment pass lets every decoder layer reshard after its forward.

The alignment losses tap q/k/v inside the layers, and the last layer's output feeds no loss; the backward still
reaches every layer's weights because a checkpointed layer is recomputed through FSDP2's pre-forward hook, which
gathers it again. Keeping all layers gathered (needed without checkpointing) cost 2 bytes per parameter, about
12 GiB at 8B. Gradients equal the unsharded model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM

from claas_verl.align import alignment_losses, alignment_signals, step_regions
from claas_verl.mopd.trainer.balanced_passes import (
    params_gathered_through_backward as _params_gathered_through_backward,
)

T, P = 40, 8


def _model(checkpointing: bool):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=100, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).float().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch():
    ids = torch.randint(10, 100, (2, T), generator=torch.Generator().manual_seed(1))
    ids[:, P + 5::6] = 7
    am = torch.ones_like(ids)
    return ids, am, step_regions(ids[:, P:], am[:, P:], {7}, window=24).pad_left(P)


def _pass(model, targets=None, after_forward=None):
    ids, am, reg = _batch()
    if targets is None:
        with torch.no_grad():
            _, sig = alignment_signals(model, ids, am, reg, terms=["sats"], pooled_layers=[0, 2], logits=False)
        targets = sig.as_targets()
        for rows in targets.sats.values():
            rows.rows.mul_(1.1)
    _, sig = alignment_signals(model, ids, am, reg, terms=["sats"], pooled_layers=[0, 2], logits=False,
                               use_cache=False)
    if after_forward is not None:
        after_forward()
    alignment_losses(sig, targets, reg)["sats"].loss.backward()
    return targets, [None if p.grad is None else p.grad for p in model.parameters()]


def test_checkpointed_layers_reshard_after_the_forward_and_gradients_match(tmp_path):
    targets, plain = _pass(_model(checkpointing=False))
    engine = type("Engine", (), {})()
    resharded = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = _model(checkpointing=True)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        engine.module = model
        with _params_gathered_through_backward(engine):
            _, sharded = _pass(model, targets, after_forward=lambda: resharded.extend(
                isinstance(layer.mlp.up_proj.weight, DTensor) for layer in model.model.layers))
        sharded = [None if g is None else g.full_tensor() for g in sharded]
    finally:
        dist.destroy_process_group()
    assert resharded == [True, True, True]  # between the forward and the backward, every layer is sharded
    for a, b in zip(plain, sharded):
        if a is None:
            assert b is None or float(b.abs().max()) == 0.0
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
