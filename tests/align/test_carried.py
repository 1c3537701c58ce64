"""The replay step at its floor and the carried approximation (docs/math.md §B.6), on a tiny Qwen3 in float64.

The floor schedule (one forward that yields the logits and every alignment signal, one backward per term on that
graph) must give the gradient of the reference: the schedule the MOPD worker runs (a token forward + backward, then
one forward + backward per term without logits, combined by ``HostBalancer``). The carried step with the
multipliers of an exact step on the same batch must give the exact gradient with one backward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from claas_verl.align import alignment_losses, alignment_signals, balanced_backward, microbatch_weights, step_regions
from claas_verl.align.balance import HostBalancer
from claas_verl.align.carried import CarriedBalance, gradient_cosine, multiplier_errors

P, L, V, SEP = 6, 3, 96, 7
NAMES = {"sats": "sats", "vr": "vr", "hid": "hidden"}


def _model(seed):
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=V, attn_implementation="eager")
    return Qwen3ForCausalLM(cfg).double().train()


def _micro_batches(teacher, seed):
    """Two micro-batches (2 and 1 responses) with step regions and the teacher's bf16 targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, T in ((2, 26), (1, 22)):
        ids = torch.randint(10, V, (n, T), generator=g)
        ids[:, P + 3::5] = SEP
        am = torch.ones_like(ids)
        if n > 1:
            am[1, -3:] = 0  # right padding
        reg = step_regions(ids[:, P:], am[:, P:], {SEP}, window=12).pad_left(P)
        with torch.no_grad():
            _, sig = alignment_signals(teacher, ids, am, reg, pooled_layers=range(L), hidden_layers=range(L),
                                       logits=False)
        A = torch.randn(n, T - P, generator=g, dtype=torch.float64)
        out.append({"input_ids": ids, "attention_mask": am, "regions": reg, "targets": sig.as_targets(), "A": A,
                    "n_resp": n})
    return out


def _tok(logits, mb):
    """A stand-in token loss on the response positions (advantage-weighted log-likelihood, B.7 token mean)."""
    lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, mb["input_ids"][:, P:, None])[..., 0]
    m = mb["attention_mask"][:, P:].double()
    return -(mb["A"] * lp * m).sum() / m.sum()


def _floor_forward(model, mb):
    return alignment_signals(model, mb["input_ids"], mb["attention_mask"], mb["regions"], pooled_layers=range(L),
                             hidden_layers=range(L))


def _floor_losses():
    def term(name):
        return lambda out, mb: alignment_losses(out[1], mb["targets"], mb["regions"])[name].loss

    return {"tok": lambda out, mb: _tok(out[0].logits, mb), **{t: term(n) for t, n in NAMES.items()}}


def _worker_schedule(model, mbs, weights, ratio, rho):
    """The MOPD worker's exact schedule: token pass, then per term one forward (no logits) + backward."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    for mb, w in zip(mbs, weights):
        (_tok(model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits, mb) * w).backward()
    hb = HostBalancer(params, ratio=ratio, rho=rho, sync=False)
    hb.take_token()
    for t, name in NAMES.items():
        for mb, w in zip(mbs, weights):
            _, sig = alignment_signals(model, mb["input_ids"], mb["attention_mask"], mb["regions"], terms=[name],
                                       pooled_layers=range(L), hidden_layers=range(L), logits=False)
            (alignment_losses(sig, mb["targets"], mb["regions"])[name].loss * w).backward()
        if t != "hid":
            hb.take_pooled(t)
    info = hb.finish("hid")
    return [None if p.grad is None else p.grad.clone() for p in params], info


@pytest.fixture(scope="module")
def setup():
    teacher = _model(1)
    return {"teacher": teacher, "mbs": _micro_batches(teacher, 2), "mbs_next": _micro_batches(teacher, 3)}


def _floor(mbs, ratio, multipliers=None):
    model = _model(0)
    weights = microbatch_weights([mb["n_resp"] for mb in mbs])
    metrics = balanced_backward(model, mbs, weights, _floor_forward, _floor_losses(), ratio=ratio, rho=2.0,
                                single_forward=True, multipliers=multipliers, sync=False)
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()], metrics


def _assert_equal(got, ref, rtol, atol_of_max):
    for g, r in zip(got, ref):
        if r is None:
            assert g is None or float(g.abs().max()) == 0.0
        else:
            torch.testing.assert_close(g, r, rtol=rtol, atol=atol_of_max * float(r.abs().max()))


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_floor_schedule_equals_the_worker_schedule(setup, ratio):
    mbs = setup["mbs"]
    ref, info = _worker_schedule(_model(0), mbs, microbatch_weights([2, 1]), ratio, 2.0)
    got, metrics = _floor(mbs, ratio)
    # the same operators per term in both schedules (the pooled rows and losses compute in fp32 inside the float64
    # model, identically); only the order of the additions of the combination differs
    _assert_equal(got, ref, 1e-10, 1e-10)
    assert metrics["balance_scale"] == pytest.approx(info["scale"], rel=1e-10)
    for t in ("tok", "sats", "vr", "hid"):  # the worker's HostBalancer reports the same multipliers
        assert metrics[f"mult_{t}"] == pytest.approx(info[f"mult_{t}"], rel=1e-10)
        assert metrics[f"mult_{t}"] > 0
    # every term matters: dropping one, or halving its multiplier, changes the gradient far beyond the tolerance
    for t in ("sats", "vr", "hid"):
        halved = {k: v for k, v in metrics.items() if k.startswith("mult_")}
        halved[f"mult_{t}"] /= 2
        off, _ = _floor(mbs, ratio, multipliers=halved)
        assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(off, got) if b is not None) > 1e-3


def test_carried_step_with_the_same_batch_multipliers_is_exact(setup):
    exact, metrics = _floor(setup["mbs"], 1.0)
    mults = {k: v for k, v in metrics.items() if k.startswith("mult_")}
    carried, cm = _floor(setup["mbs"], 1.0, multipliers=mults)
    assert cm["balance_carried"] == 1.0 and all(cm[f"{t}_loss"] > 0 for t in ("sats", "vr", "hid"))
    # equal up to fp32 rounding: the pooled rows and the losses compute in fp32, and one backward of Σ α_t·ℓ_t
    # scales the fp32 intermediates by α_t (up to ~1e3 here) where the exact step scales the finished gradients
    _assert_equal(carried, exact, 1e-4, 1e-6)


def test_carried_multipliers_of_another_batch_are_an_approximation(setup):
    """Multipliers of batch 1 applied to batch 2: close to, not equal to, batch 2's exact step."""
    _, m1 = _floor(setup["mbs"], 1.0)
    exact2, m2 = _floor(setup["mbs_next"], 1.0)
    carried2, _ = _floor(setup["mbs_next"], 1.0, multipliers={k: v for k, v in m1.items() if k.startswith("mult_")})
    err = multiplier_errors(m1, m2)
    assert set(err) == {"tok", "sats", "vr", "hid"} and err["tok"] == 0.0  # r = 1: α_tok = 1 always
    assert max(err.values()) > 1e-6
    cos = gradient_cosine(carried2, exact2)
    assert 0.5 < cos < 1.0 - 1e-9


def test_carried_balance_refreshes_every_k_steps():
    cb = CarriedBalance(refresh=3)
    exact = {"mult_tok": 1.0, "mult_sats": 0.5}
    plans = []
    for _ in range(7):
        m = cb.plan("math")
        plans.append(m is not None)
        if m is None:
            cb.record("math", {**exact, "tok_grad_norm": 2.0})
        else:
            assert m == exact
    assert plans == [False, True, True, False, True, True, False]
    assert cb.plan("code") is None  # a key of its own
    assert all(CarriedBalance(1).plan("math") is None for _ in range(3))
    with pytest.raises(ValueError, match="refresh"):
        CarriedBalance(0)
    with pytest.raises(ValueError, match="mult_tok"):
        cb.record("math", {"mult_sats": 1.0})
    with pytest.raises(ValueError, match="non-finite"):
        cb.record("math", {"mult_tok": float("nan")})
    # a step that fell back (zero token or auxiliary gradient) is not carried: the next step is exact again
    assert cb.record("math", {**exact, "balance_fallback": 1.0}) is None and cb.plan("math") is None
    assert cb.record("math", {"mult_tok": 0.0, "mult_sats": 0.0}) is None and cb.plan("math") is None
    cb.record("math", exact)
    restored = CarriedBalance(5)
    restored.load_state_dict(cb.state_dict())
    assert restored.refresh == 3 and restored.plan("math") == exact
