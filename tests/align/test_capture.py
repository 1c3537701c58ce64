"""q/k/v capture from HF models without editing transformers (docs/math.md §B.4, B.5), tiny random models."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from claas_verl.align import AttentionCapture, pooled_attention_rows, step_regions

FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),  # q_norm/k_norm before RoPE
}


def tiny_model(family="qwen2", attn="eager", seed=0):
    cfg_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, head_dim=16,
                  attn_implementation=attn)
    return model_cls(cfg).eval()


def left_padded_batch(seed=0, b=3, t=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (b, t), generator=gen)
    am = torch.ones(b, t, dtype=torch.long)
    am[1, :4] = 0  # left padding
    am[2, :2] = 0
    am[2, -3:] = 0  # right padding after the response
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    return ids, am, pos


def _attn_outputs(model, layers):
    store, handles = {}, []
    mods = [m for m in model.modules() if hasattr(m, "q_proj")]
    for layer in layers:
        def hook(mod, args, out, layer=layer):
            store[layer] = out
        handles.append(mods[layer].register_forward_hook(hook))
    return store, handles


def _reconstruct(mod, q, k, v, am):
    """o_proj(softmax(q·repeat_kv(k)ᵀ·scale, causal & real keys)·repeat_kv(v)) from captured tensors."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = q.shape[2]
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & am.bool()[:, None, :]
    scores = (q @ k.transpose(-1, -2)) * mod.scaling
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
    out = (probs @ v).transpose(1, 2).flatten(2)
    return mod.o_proj(out), probs


@pytest.mark.parametrize("family,attn", [("qwen2", "eager"), ("qwen2", "sdpa"), ("llama", "sdpa"), ("qwen3", "eager")])
def test_reconstructs_model_attention_output(family, attn):
    model = tiny_model(family, attn)
    ids, am, pos = left_padded_batch()
    layers = [0, 3]
    store, handles = _attn_outputs(model, layers)
    with torch.no_grad(), AttentionCapture(model, layers) as cap:
        model(input_ids=ids, attention_mask=am, position_ids=pos)
    for hnd in handles:
        hnd.remove()
    qkv = cap.result()
    mods = [m for m in model.modules() if hasattr(m, "q_proj")]
    real = am.bool()
    for layer in layers:
        q, k, v = qkv.queries[layer], qkv.keys[layer], qkv.values[layer]
        assert q.shape == (3, 4, 12, 16) and k.shape == (3, 2, 12, 16) and v.shape == (3, 2, 12, 16)
        rebuilt, probs = _reconstruct(mods[layer], q, k, v, am)
        model_out, model_probs = store[layer]
        # compare at real query positions (rows of padded queries are not defined by the model)
        assert (rebuilt[real] - model_out[real]).abs().max() < 1e-5
        if attn == "eager":  # eager also returns its probabilities: rows must match exactly where real
            diff = (probs - model_probs).abs().masked_select(real[:, None, :, None].expand_as(probs))
            assert diff.max() < 1e-6


def test_pooled_rows_equal_model_attention_rows():
    # The SATS rows from captured q/k equal region means of the eager model's own probabilities.
    model = tiny_model("qwen2", "eager")
    ids, am, pos = left_padded_batch(seed=1)
    store, handles = _attn_outputs(model, [2])
    with torch.no_grad(), AttentionCapture(model, [2]) as cap:
        model(input_ids=ids, attention_mask=am, position_ids=pos)
    handles[0].remove()
    qkv = cap.result()
    prompt = 5
    resp_ids = ids[:, prompt:].clone()
    resp_ids[:, 2] = 7  # token 7 as the separator: regions [0..2], [3..]
    reg = step_regions(resp_ids, am[:, prompt:], {7}, window=5).pad_left(prompt)
    rows = pooled_attention_rows(qkv.queries[2], qkv.keys[2], am, reg.region_ids, reg.num_regions, chunk_size=2)
    probs = store[2][1]  # [B, H, T, T]
    for b in range(3):
        for r in range(int(reg.num_regions[b])):
            sel = reg.region_ids[b] == r
            expect = probs[b][:, sel].mean(1)[:, rows.key_start : rows.key_start + rows.rows.shape[-1]]
            assert (rows.rows[b, :, r] - expect).abs().max() < 1e-6


def test_keeps_autograd_and_no_grad():
    model = tiny_model()
    ids, am, pos = left_padded_batch()
    with AttentionCapture(model, [1]) as cap:
        model(input_ids=ids, attention_mask=am, position_ids=pos)
    qkv = cap.result()
    (qkv.queries[1].sum() + qkv.keys[1].pow(2).sum() + qkv.values[1].sum()).backward()
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.grad.abs().sum() > 0 and attn.k_proj.weight.grad.abs().sum() > 0
    assert attn.v_proj.weight.grad.abs().sum() > 0
    assert model.model.layers[2].self_attn.q_proj.weight.grad is None  # later layers untouched
    with torch.no_grad(), AttentionCapture(model, [1]) as cap:
        model(input_ids=ids, attention_mask=am, position_ids=pos)
    assert not cap.result().queries[1].requires_grad
    # hooks are removed on exit: a later forward records nothing new
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert n_hooks == 0


def test_bad_layer_raises():
    with pytest.raises(ValueError, match="out of range"):
        AttentionCapture(tiny_model(), [4])


def test_qwen3_norms_under_fsdp2_resharded_layers(tmp_path):
    """Qwen3's per-head q/k norms come from inside the layer's forward: under FSDP2 (gloo, one rank, like the CPU
    recipes) a layer reshards after its forward, so norms applied afterwards would mix its DTensor weights with
    plain activations. Captured q/k/v must equal those of the same model unsharded."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    ids, am, pos = left_padded_batch(seed=2)
    layers = [1, 3]
    plain = tiny_model("qwen3", "sdpa", seed=3)
    with torch.no_grad(), AttentionCapture(plain, layers) as cap:
        plain(input_ids=ids, attention_mask=am, position_ids=pos)
    want = cap.result()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        sharded = tiny_model("qwen3", "sdpa", seed=3)
        for layer in sharded.model.layers:
            fully_shard(layer)  # reshard_after_forward=True: verl's teacher engines
        fully_shard(sharded)
        with torch.no_grad(), AttentionCapture(sharded, layers) as cap:
            sharded(input_ids=ids, attention_mask=am, position_ids=pos)
        got = cap.result()
    finally:
        dist.destroy_process_group()
    for layer in layers:
        for name in ("queries", "keys", "values"):
            a, b = getattr(got, name)[layer], getattr(want, name)[layer]
            assert type(a) is torch.Tensor, f"{name}[{layer}] is a {type(a).__name__}"
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
