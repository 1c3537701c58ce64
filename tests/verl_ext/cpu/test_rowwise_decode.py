"""Row-by-row linear products for batched decoding (claas_verl/verl_ext/cpu/rowwise_decode.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from claas_verl.verl_ext.cpu import rowwise_decode
from claas_verl.verl_ext.cpu.rowwise_decode import rowwise_decode_matches, rowwise_linears


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(64, 37), (64, 2), (2, 64)])  # a LoRA rank of 2 takes other kernels batched
def test_a_decode_batch_gets_each_rows_lone_product(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(*shape, bias=bias)
    x = torch.randn(5, 1, shape[0])
    with rowwise_linears(layer):
        got = layer(x)
    alone = torch.cat([F.linear(x[i : i + 1], layer.weight, layer.bias) for i in range(5)])
    assert torch.equal(got, alone)


def test_other_shapes_are_the_plain_product_and_the_layers_are_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    for x in (torch.randn(4, 6, 8), torch.randn(1, 1, 8), torch.randn(3, 8)):  # a prefill, one row, 2-D
        with rowwise_linears(model):
            got = model(x)
        assert torch.equal(got, model(x))
    with pytest.raises(RuntimeError, match="inside"), rowwise_linears(model):
        raise RuntimeError("inside")
    assert all("forward" not in m.__dict__ for m in model.modules())


def _prefill(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir / "student", attn_implementation="sdpa").eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), use_cache=True)
    return model, out.past_key_values, out.logits.shape[-1]


def test_the_check_holds_for_the_tiny_model_and_leaves_the_prefill_unchanged(tiny_model_dir):
    model, past, vocab = _prefill(tiny_model_dir)
    keys = [layer.keys.clone() for layer in past.layers]
    assert rowwise_decode_matches(model, past, vocab)
    assert [layer.keys.shape for layer in past.layers] == [k.shape for k in keys]
    assert all(torch.equal(layer.keys, k) for layer, k in zip(past.layers, keys))


def test_the_check_fails_when_a_batch_rounds_differently(tiny_model_dir, monkeypatch):
    model, past, vocab = _prefill(tiny_model_dir)
    exact = rowwise_decode._rowwise_linear

    def off_by_rounding(layer, x):  # what a BLAS whose batched kernel rounds differently would give
        y = exact(layer, x)
        return y if x.shape[0] == 1 else y * (1 + 2**-20)

    monkeypatch.setattr(rowwise_decode, "_rowwise_linear", off_by_rounding)
    assert not rowwise_decode_matches(model, past, vocab)
