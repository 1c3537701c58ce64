"""Teacher alignment targets bounded in host RAM (TeacherTargetStore), their predicted sizes, and forwards that
keep no logits (alignment_signals(logits=False))."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from claas_verl.align import TeacherTargetStore, alignment_signals, step_regions, target_bytes
from claas_verl.align.target_store import signals_bytes

LAYERS = [1, 3]


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=128)
    return Qwen3ForCausalLM(cfg).eval()


def _micro_batches(n=3, seed=0):
    """Right-padded prompt+response micro-batches of 2 rows with separator-delimited regions (sep id 7)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P, R = 5 + i, 10 + 3 * i
        ids = torch.randint(10, 300, (2, P + R), generator=g)
        ids[:, P + 3] = 7
        ids[0, P + 7] = 7
        am = torch.ones_like(ids)
        am[1, -2:] = 0  # row 1 is shorter
        resp_mask = am[:, P:]
        reg = step_regions(ids[:, P:], resp_mask, {7}, window=8).pad_left(P)
        out.append((ids, am, reg))
    return out


def _produce(model, mbs, calls=None):
    def produce(i, terms):
        if calls is not None:
            calls.append((i, terms))
        ids, am, reg = mbs[i]
        with torch.no_grad():
            _, sig = alignment_signals(model, ids, am, reg, terms=terms, pooled_layers=LAYERS, hidden_layers=LAYERS,
                                       logits=False)
        return sig.as_targets()
    return produce


def _sizes(model, mbs, terms):
    c = model.config
    return [target_bytes(reg, am, terms, pooled_layers=len(LAYERS), hidden_layers=len(LAYERS),
                         num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                         hidden_size=c.hidden_size) for _, am, reg in mbs]


@pytest.mark.parametrize("terms", [("sats",), ("vr",), ("hidden",), ("sats", "vr", "hidden")])
def test_predicted_bytes_equal_the_targets_bytes(terms):
    model, mbs = _model(), _micro_batches()
    produce = _produce(model, mbs)
    for i, size in enumerate(_sizes(model, mbs, terms)):
        assert size == signals_bytes(produce(i, terms)) > 0


def test_store_keeps_a_prefix_within_budget_and_streams_the_rest_exactly():
    terms = ("sats", "vr", "hidden")
    model, mbs = _model(), _micro_batches()
    sizes = _sizes(model, mbs, terms)
    full = TeacherTargetStore(_produce(model, mbs), sizes, terms, max_bytes=sum(sizes)).fill()
    assert full.kept == 3 and full.teacher_forwards == 3 and full.held_bytes == sum(sizes)

    calls = []
    budget = sizes[0] + sizes[1] - 1  # room for micro-batch 0 only
    store = TeacherTargetStore(_produce(model, mbs, calls), sizes, terms, max_bytes=budget).fill()
    assert store.kept == 1 and calls == [(0, terms)] and store.held_bytes == sizes[0] <= budget
    for term in terms:  # the student's order: term by term, micro-batch by micro-batch
        for i in range(3):
            got, want = store.get(i, term), full.get(i, term)
            for name in ("sats", "vr"):
                assert set(getattr(got, name)) == (set(LAYERS) if name == term else set())
                for k, v in getattr(got, name).items():
                    ref = getattr(want, name)[k]
                    assert torch.equal(v.rows, ref.rows) and v.key_start == ref.key_start
            assert set(got.hidden) == (set(LAYERS) if term == "hidden" else set())
            for k, v in got.hidden.items():
                assert torch.equal(v, want.hidden[k])
    # micro-batches 1 and 2 were streamed once per term; 0 came from RAM
    assert calls[1:] == [(i, (t,)) for t in terms for i in (1, 2)]
    assert store.teacher_forwards == 1 + 2 * len(terms)
    one_term_max = max(s for t in terms for s in _sizes(model, mbs[1:], (t,)))
    assert store.held_bytes <= budget and store.peak_bytes <= budget + one_term_max


def test_zero_budget_streams_everything_and_bad_budget_raises():
    model, mbs = _model(), _micro_batches(n=2)
    sizes = _sizes(model, mbs, ("hidden",))
    store = TeacherTargetStore(_produce(model, mbs), sizes, ("hidden",), max_bytes=0).fill()
    assert store.kept == 0 and store.teacher_forwards == 0 and store.held_bytes == 0
    assert len(list(store)) == 2 and store.teacher_forwards == 2
    with pytest.raises(ValueError, match="max_bytes"):
        TeacherTargetStore(_produce(model, mbs), sizes, ("hidden",), max_bytes=-1)
    with pytest.raises(ValueError, match="not one of"):
        store.get(0, "sats")


def test_alignment_forward_keeps_no_logits_and_same_signals():
    model, mbs = _model(), _micro_batches(n=1)
    ids, am, reg = mbs[0]
    kw = dict(pooled_layers=LAYERS, hidden_layers=LAYERS)
    out_a, sig_a = alignment_signals(model, ids, am, reg, **kw)
    out_b, sig_b = alignment_signals(model, ids, am, reg, logits=False, **kw)
    assert out_a.logits.shape == (*ids.shape, 300) and out_b.logits.shape == (ids.shape[0], 0, 300)
    for k in LAYERS:
        assert torch.equal(sig_a.sats[k].rows, sig_b.sats[k].rows) and torch.equal(sig_a.vr[k].rows, sig_b.vr[k].rows)
        assert torch.equal(sig_a.hidden[k], sig_b.hidden[k])
    # the student's gradient flows without logits
    loss = sum(v.rows.pow(2).sum() for v in sig_b.sats.values()) + sum(h.sum() for h in sig_b.hidden.values())
    loss.backward()
    assert model.model.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert model.lm_head.weight.grad is None or model.lm_head.weight.grad.abs().sum() == 0
