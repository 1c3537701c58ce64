"""balanced_backward on a tiny random Qwen2 (docs/math.md §B.6-B.7): same update as per-term gradients combined by
hand."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from claas_verl.align.balance import balance, combine_aux, combine_one_one_one
from claas_verl.align.multipass import balanced_backward, microbatch_weights
from claas_verl.distill import (
    domain_normalized_advantages,
    student_topk,
    teacher_logprobs_at,
    topk_distill_loss,
    topk_rewards,
)

VOCAB, K = 64, 4


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    return Qwen2ForCausalLM(cfg).double()


def _micro_batches(model, seed=1):
    """Three micro-batches of 2, 1, 3 responses; the token-channel targets are built at θ_old, as in B.2.1."""
    g = torch.Generator().manual_seed(seed)
    teacher = _model(seed=5)
    mbs = []
    for n_resp, T in [(2, 6), (1, 5), (3, 4)]:
        input_ids = torch.randint(0, VOCAB, (n_resp, T), generator=g)
        attention_mask = torch.ones(n_resp, T, dtype=torch.long)
        if n_resp > 1:
            attention_mask[-1, -2:] = 0  # right padding in the last response
        mask = attention_mask.clone()
        with torch.no_grad():
            ids, S = student_topk(model(input_ids=input_ids, attention_mask=attention_mask).logits, K)
            Q = teacher_logprobs_at(teacher(input_ids=input_ids, attention_mask=attention_mask).logits, ids)
        A = domain_normalized_advantages(topk_rewards(S, Q, mask), mask)
        targets = [torch.randn(n_resp, T, 32, generator=g, dtype=torch.float64) for _ in range(3)]
        mbs.append(
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "mask": mask,
                "ids": ids,
                "A": A,
                "targets": targets,
                "n_resp": n_resp,
            }
        )
    return mbs


def _forward(model, mb):
    return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_hidden_states=True)


def _masked_mse(h, target, mask):
    m = mask.unsqueeze(-1).to(h.dtype)
    return (((h - target) ** 2) * m).sum() / (m.sum() * h.shape[-1])


# Stand-ins for the alignment terms (the real SATS/VR/hidden losses live elsewhere in claas_verl.align): any
# differentiable functions of the shared forward output exercise the same gradient plumbing.
LOSSES = {
    "tok": lambda out, mb: topk_distill_loss(out.logits, mb["ids"], mb["A"], mb["mask"], chunk_size=5),
    "sats": lambda out, mb: _masked_mse(out.hidden_states[1], mb["targets"][0], mb["mask"]),
    "vr": lambda out, mb: _masked_mse(out.hidden_states[2].tanh(), mb["targets"][1], mb["mask"]),
    "hid": lambda out, mb: _masked_mse(out.hidden_states[0] * 0.1 + out.hidden_states[2], mb["targets"][2], mb["mask"]),
}


def _by_hand(model, mbs, weights, terms):
    """g_term = ∇ Σ_mb w(mb)·ℓ_term(mb), one autograd.grad per term with fresh forwards."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {}
    for t in terms:
        total = sum(w * LOSSES[t](_forward(model, mb), mb) for mb, w in zip(mbs, weights))
        grads[t] = list(torch.autograd.grad(total, params, allow_unused=True))
    return params, grads


@pytest.fixture(scope="module")
def setup():
    """Model, micro-batches, weights and the per-term gradients computed by hand (computed once: CPU is shared)."""
    model = _model()
    mbs = _micro_batches(model)
    weights = microbatch_weights([mb["n_resp"] for mb in mbs])
    params, g = _by_hand(model, mbs, weights, ["tok", "sats", "vr", "hid"])
    return model, mbs, weights, params, g


@pytest.fixture(scope="module")
def fsar_runs(setup):
    """balanced_backward in both schedules: {single_forward: (grads, metrics)}."""
    model, mbs, weights, params, _ = setup
    runs = {}
    for single in (True, False):
        metrics = balanced_backward(model, mbs, weights, _forward, LOSSES, ratio=0.5, rho=2.0, single_forward=single)
        runs[single] = ([p.grad.clone() for p in params], metrics)
    return runs


def test_microbatch_weights():
    assert microbatch_weights([2, 1, 3]) == [2 / 6, 1 / 6, 3 / 6]
    with pytest.raises(ValueError, match="n_resp"):
        microbatch_weights([0, 0])


@pytest.mark.parametrize("single_forward", [True, False])
def test_fsar_matches_hand_combination(setup, fsar_runs, single_forward):
    _, _, _, params, g = setup
    g_aux, ainfo = combine_aux(g["sats"], g["vr"], g["hid"], rho=2.0)
    expected, binfo = balance(g["tok"], g_aux, ratio=0.5)
    grads, metrics = fsar_runs[single_forward]
    for got, e in zip(grads, expected):
        torch.testing.assert_close(got, e, rtol=1e-9, atol=1e-12)
    assert metrics["balance_scale"] == pytest.approx(binfo["scale"], rel=1e-9)
    assert metrics["cos_u_hid"] == pytest.approx(ainfo["cos_u_hid"], rel=1e-9)
    assert metrics["sats_grad_norm"] == pytest.approx(ainfo["sats_norm"], rel=1e-9)
    assert metrics["tok_grad_norm"] > 0 and metrics["sats_grad_norm"] > 0
    total = torch.sqrt(sum((x**2).sum() for x in grads)).item()
    assert metrics["final_grad_norm"] == pytest.approx(total, rel=1e-9)


def test_single_forward_equals_separate_passes(fsar_runs):
    for a, b in zip(fsar_runs[True][0], fsar_runs[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    for k, v in fsar_runs[True][1].items():
        assert fsar_runs[False][1][k] == pytest.approx(v, rel=1e-9, abs=1e-12)


def test_token_only_is_plain_weighted_gradient_and_old_grads_are_discarded(setup):
    model, mbs, weights, params, g = setup
    for p in params:
        p.grad = torch.ones_like(p)  # stale gradient from elsewhere must not leak in
    balanced_backward(model, mbs, weights, _forward, {"tok": LOSSES["tok"]})
    for p, e in zip(params, g["tok"]):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-13)


def test_one_one_one_variant(setup):
    model, mbs, weights, params, g = setup
    expected, _ = combine_one_one_one(g["tok"], g["sats"], g["hid"])
    losses = {t: LOSSES[t] for t in ("tok", "sats", "hid")}
    balanced_backward(model, mbs, weights, _forward, losses, variant="1:1:1")
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-9, atol=1e-12)


def test_optimizer_step_changes_parameters(setup):
    _, mbs, _, _, _ = setup
    model = _model(seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    balanced_backward(model, mbs[:1], [1.0], _forward, LOSSES)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
    opt.step()
    changed = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert changed == len(before)


def test_bad_arguments(setup):
    model, mbs, weights, _, _ = setup
    with pytest.raises(ValueError, match="'tok'"):
        balanced_backward(model, mbs, weights, _forward, {"sats": LOSSES["sats"]})
    with pytest.raises(ValueError, match="weights"):
        balanced_backward(model, mbs, weights[:2], _forward, LOSSES)
    with pytest.raises(ValueError, match="unknown"):
        balanced_backward(model, mbs, weights, _forward, {"tok": LOSSES["tok"], "kl": LOSSES["sats"]})
    with pytest.raises(ValueError, match="1:1:1"):
        balanced_backward(model, mbs, weights, _forward, LOSSES, variant="1:1:1")
