"""Gradient-norm balancing (docs/math.md §B.6, eqs. 9-10): worked example, invariants, edge cases, forms, ranks."""

import math

import pytest
import torch

from claas_verl.align.balance import HostBalancer, balance, combine_aux, combine_one_one_one, grad_norm

DT = torch.float64


def _e(i, n=5):
    v = torch.zeros(n, dtype=DT)
    v[i] = 1.0
    return v


def _worked_example_vectors():
    """Explicit vectors with the cosines of the MOPD paper's worked example (docs/math.md §B.6)."""
    cos_sv, cos_uh = 0.248, 0.575
    g_sats = 0.923 * _e(0)
    vr_hat = cos_sv * _e(0) + math.sqrt(1 - cos_sv**2) * _e(1)
    g_vr = 0.268 * vr_hat
    s = _e(0) + vr_hat
    u = s / s.norm()
    hid_hat = cos_uh * u + math.sqrt(1 - cos_uh**2) * _e(2)
    g_hid = 7.9e-5 * hid_hat
    g_tok = 26.35 * (0.6 * _e(3) + 0.8 * _e(0))  # any direction; ‖g_tok‖ = 26.35
    return g_tok, g_sats, g_vr, g_hid, vr_hat, u, hid_hat


def test_worked_example_003():
    g_tok, g_sats, g_vr, g_hid, vr_hat, u, hid_hat = _worked_example_vectors()
    g_aux, ainfo = combine_aux(g_sats, g_vr, g_hid, rho=2.0)
    # ‖s‖ = √(2 + 2·0.248) = √2.496 = 1.57987
    assert ainfo["s_norm"] == pytest.approx(1.5799, abs=5e-5)
    assert ainfo["cos_sats_vr"] == pytest.approx(0.248, abs=1e-12)
    assert ainfo["cos_u_hid"] == pytest.approx(0.575, abs=1e-12)
    # ‖g_aux‖ = √(1 + 4 + 4·0.575) = √7.3 = 2.70185
    assert ainfo["aux_norm"] == pytest.approx(2.7019, abs=5e-5)
    assert g_aux.norm().item() == pytest.approx(math.sqrt(7.3), rel=1e-12)
    g, info = balance(g_tok, g_aux, ratio=1.0)
    c = 26.35 / math.sqrt(7.3)  # 9.75259
    assert info["scale"] == pytest.approx(c, rel=1e-12)
    assert info["scale"] == pytest.approx(9.75, abs=5e-3)
    # decompose the aux part in the basis ĝ_SATS, ĝ_VR, ĝ_hid: weights c/‖s‖, c/‖s‖, c·ρ
    aux_part = g - g_tok
    basis = torch.stack([_e(0), vr_hat, hid_hat], dim=1)
    coef = torch.linalg.lstsq(basis, aux_part.unsqueeze(1)).solution.squeeze(1)
    assert coef[0].item() == pytest.approx(c / math.sqrt(2.496), rel=1e-9)  # 6.173
    assert coef[0].item() == pytest.approx(6.173, abs=5e-4)
    assert coef[1].item() == pytest.approx(coef[0].item(), rel=1e-9)
    hidden_part = coef[2] * hid_hat
    pooled_part = aux_part - hidden_part
    assert hidden_part.norm().item() == pytest.approx(19.505, abs=5e-4)  # not the MOPD paper's typo 151
    assert pooled_part.norm().item() == pytest.approx(9.753, abs=5e-4)
    assert aux_part.norm().item() == pytest.approx(26.35, rel=1e-12)  # = ‖g_tok‖·min(1, 1/r)
    cos_tok_aux = torch.dot(g_tok, g_aux).item() / (26.35 * math.sqrt(7.3))
    assert g.norm().item() == pytest.approx(26.35 * math.sqrt(2 + 2 * cos_tok_aux), rel=1e-12)
    assert info["final_norm"] == pytest.approx(g.norm().item(), rel=1e-12)


def _random_pair(seed, n=50):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=DT) * 3, torch.randn(n, generator=g, dtype=DT) * 0.01


@pytest.mark.parametrize("r", [0.33, 0.5, 1.0, 2.0, 3.0])
def test_ratio_of_parts_and_norm_formula(r):
    g_tok, g_aux = _random_pair(1)
    g, info = balance(g_tok, g_aux, ratio=r)
    a, b = min(1.0, r), min(1.0, 1.0 / r)
    tok_part = a * g_tok
    aux_part = g - tok_part
    assert (tok_part.norm() / aux_part.norm()).item() == pytest.approx(r, rel=1e-12)
    # the aux part is parallel to g_aux
    assert torch.dot(aux_part, g_aux).item() / (aux_part.norm() * g_aux.norm()).item() == pytest.approx(1.0, rel=1e-12)
    cos = torch.dot(g_tok, g_aux).item() / (g_tok.norm() * g_aux.norm()).item()
    expected = g_tok.norm().item() * math.sqrt(a * a + b * b + 2 * a * b * cos)
    assert g.norm().item() == pytest.approx(expected, rel=1e-12)
    assert info["final_norm"] == pytest.approx(expected, rel=1e-12)
    assert info["cos_tok_aux"] == pytest.approx(cos, rel=1e-12)


def test_r_equal_one_norm_sqrt_2_plus_2cos():
    # g_tok = (3, 0), g_aux = (0.01, 0.01): cos φ = 1/√2 -> ‖g‖ = 3·√(2+√2)
    g, _ = balance(torch.tensor([3.0, 0.0], dtype=DT), torch.tensor([0.01, 0.01], dtype=DT), 1.0)
    assert g.norm().item() == pytest.approx(3 * math.sqrt(2 + math.sqrt(2)), rel=1e-12)
    # explicit: g = g_tok + ‖g_tok‖·ĝ_aux = (3 + 3/√2, 3/√2)
    torch.testing.assert_close(g, torch.tensor([3 + 3 / math.sqrt(2), 3 / math.sqrt(2)], dtype=DT))


def test_both_branches_explicit():
    g_tok = torch.tensor([4.0, 0.0, 0.0], dtype=DT)
    g_aux = torch.tensor([0.0, 0.5, 0.0], dtype=DT)  # orthogonal, ‖g_aux‖ = 0.5
    # r = 2 ≥ 1: g = g_tok + ‖g_tok‖/(r‖g_aux‖)·g_aux = (4, 4/(2·0.5)·0.5, 0) = (4, 2, 0)
    g, info = balance(g_tok, g_aux, 2.0)
    torch.testing.assert_close(g, torch.tensor([4.0, 2.0, 0.0], dtype=DT))
    assert info["scale"] == 8.0  # c = 4/0.5
    # r = 0.5 < 1: g = r·g_tok + ‖g_tok‖/‖g_aux‖·g_aux = (2, 4, 0): the token gradient is scaled down
    g, info = balance(g_tok, g_aux, 0.5)
    torch.testing.assert_close(g, torch.tensor([2.0, 4.0, 0.0], dtype=DT))
    assert info["tok_coef"] == 0.5 and info["aux_coef"] == 8.0


def test_norm_drops_below_token_norm_only_for_opposed_directions():
    # r = 2: ‖g‖ > ‖g_tok‖ unless cos φ < −1/(2r) = −0.25
    g_tok = torch.tensor([1.0, 0.0], dtype=DT)
    for cos, above in [(-0.2, True), (-0.3, False)]:
        g_aux = torch.tensor([cos, math.sqrt(1 - cos * cos)], dtype=DT)
        g, _ = balance(g_tok, g_aux, 2.0)
        assert (g.norm().item() > 1.0) == above
    # r = 0.5: unless cos φ < −r/2 = −0.25 as well
    for cos, above in [(-0.2, True), (-0.3, False)]:
        g_aux = torch.tensor([cos, math.sqrt(1 - cos * cos)], dtype=DT)
        g, _ = balance(g_tok, g_aux, 0.5)
        assert (g.norm().item() > 1.0) == above


def test_zero_norm_fallbacks():
    g_tok = torch.tensor([1.0, 2.0], dtype=DT)
    for aux in (torch.zeros(2, dtype=DT), torch.full((2,), 1e-40, dtype=DT), None):
        for r in (0.5, 1.0, 2.0):
            g, info = balance(g_tok, aux, r)
            assert torch.equal(g, g_tok) and info["fallback"] == 1.0
    g, info = balance(torch.zeros(2, dtype=DT), torch.tensor([1.0, 0.0], dtype=DT), 1.0)
    assert torch.equal(g, torch.zeros(2, dtype=DT)) and info["fallback"] == 2.0


def test_combine_aux_unit_vector_conventions():
    h = torch.tensor([0.0, 0.0, 5.0], dtype=DT)
    zero = torch.zeros(3, dtype=DT)
    # no region anywhere: ĝ_SATS = ĝ_VR = 0 -> s = u = 0 -> g_aux = ρ·ĝ_hid
    g_aux, info = combine_aux(zero, zero, h, rho=2.0)
    torch.testing.assert_close(g_aux, torch.tensor([0.0, 0.0, 2.0], dtype=DT))
    assert info["s_norm"] == 0.0 and not math.isnan(info["cos_u_hid"])
    # everything zero: g_aux = 0 and balance falls back to g_tok, never NaN
    g_aux, _ = combine_aux(zero, zero, zero)
    assert torch.equal(g_aux, zero)
    g, _ = balance(torch.ones(3, dtype=DT), g_aux)
    assert torch.equal(g, torch.ones(3, dtype=DT))
    # only SATS (Replay-KL + SATS): g_aux = ĝ_SATS
    g_aux, _ = combine_aux(torch.tensor([0.0, 3.0, 4.0], dtype=DT), None, None)
    torch.testing.assert_close(g_aux, torch.tensor([0.0, 0.6, 0.8], dtype=DT))
    # opposite SATS and VR: s = 0 exactly -> u := 0
    g_aux, info = combine_aux(torch.tensor([1.0, 0, 0], dtype=DT), torch.tensor([-2.0, 0, 0], dtype=DT), h)
    torch.testing.assert_close(g_aux, torch.tensor([0.0, 0.0, 2.0], dtype=DT))


def test_one_one_one_variant():
    g_tok = torch.tensor([2.0, 0.0, 0.0], dtype=DT)
    g_sats = torch.tensor([0.0, 0.1, 0.0], dtype=DT)
    g_other = torch.tensor([0.0, 0.0, -7.0], dtype=DT)
    # g = g_tok + 2·ĝ_SATS + 2·ĝ_other = (2, 2, −2)
    g, info = combine_one_one_one(g_tok, g_sats, g_other)
    torch.testing.assert_close(g, torch.tensor([2.0, 2.0, -2.0], dtype=DT))
    assert info["sats_coef"] == pytest.approx(20.0) and info["other_coef"] == pytest.approx(2 / 7)
    g, _ = combine_one_one_one(g_tok, torch.zeros(3, dtype=DT), g_other)  # zero SATS: ĝ := 0
    torch.testing.assert_close(g, torch.tensor([2.0, 0.0, -2.0], dtype=DT))


def _split(flat, shapes):
    out, i = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[i : i + n].view(s))
        i += n
    return out


def test_list_of_tensors_equals_flat():
    shapes = [(3, 4), (5,), (2, 2, 2), (7,)]
    n = sum(math.prod(s) for s in shapes)
    g = torch.Generator().manual_seed(7)
    tok, sats, vr, hid = (torch.randn(n, generator=g, dtype=DT) for _ in range(4))
    vr[12:17] = 0.0  # the (5,) parameter gets no VR gradient: passed as None in list form
    flat_aux, flat_ainfo = combine_aux(sats, vr, hid)
    flat_g, flat_info = balance(tok, flat_aux, 0.5)
    as_list = [_split(x, shapes) for x in (tok, sats, vr, hid)]
    as_list[2][1] = None
    list_aux, list_ainfo = combine_aux(as_list[1], as_list[2], as_list[3])
    list_g, list_info = balance(as_list[0], list_aux, 0.5)
    assert isinstance(list_g, list) and len(list_g) == 4
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in list_g]), flat_g, rtol=1e-12, atol=1e-14)
    for k in ("tok_norm", "aux_norm", "cos_tok_aux", "scale", "final_norm"):
        assert list_info[k] == pytest.approx(flat_info[k], rel=1e-12)
    for k in ("cos_sats_vr", "cos_u_hid", "s_norm"):
        assert list_ainfo[k] == pytest.approx(flat_ainfo[k], rel=1e-12)
    # an entry that is None in every term stays None
    none_lists = [[None] + x[1:] for x in as_list]
    out, _ = balance(none_lists[0], combine_aux(*none_lists[1:])[0])
    assert out[0] is None
    assert grad_norm(as_list[0]) == pytest.approx(tok.norm().item(), rel=1e-12)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="ratio"):
        balance(torch.ones(2), torch.ones(2), 0.0)
    with pytest.raises(ValueError, match="g_aux"):
        balance(torch.ones(2), [torch.ones(2)])
    with pytest.raises(ValueError, match="shapes"):
        balance([torch.ones(2)], [torch.ones(3)])
    with pytest.raises(ValueError, match="g_tok"):
        balance(None, torch.ones(2))
    with pytest.raises(ValueError, match="sync=True"):
        balance(torch.ones(2), torch.ones(2), sync=True)


def test_sharded_across_two_simulated_ranks(simulated_ranks):
    """Each rank holds half of every gradient (FSDP-like shards): the all-reduced result equals the unsharded one."""
    g = torch.Generator().manual_seed(11)
    tok, sats, vr, hid = (torch.randn(40, generator=g, dtype=DT) for _ in range(4))
    aux_full, _ = combine_aux(sats, vr, hid)
    g_full, info_full = balance(tok, aux_full, 1.0)

    fake = simulated_ranks(2)

    def rank_fn(k):
        sl = slice(0, 25) if k == 0 else slice(25, 40)  # unequal shards
        aux, _ = combine_aux(sats[sl], vr[sl], hid[sl])
        return balance(tok[sl], aux, 1.0)

    outs = fake.run(rank_fn)
    torch.testing.assert_close(torch.cat([o[0] for o in outs]), g_full, rtol=1e-12, atol=1e-14)
    assert outs[1][1]["final_norm"] == pytest.approx(info_full["final_norm"], rel=1e-12)
    assert fake.calls == 2  # one collective for eq. (10), one for eq. (9)
    # replicated gradients (DDP) must not be reduced: sync=False keeps the local values
    g_local, info_local = balance(tok, aux_full, 1.0, sync=False)
    assert info_local["tok_norm"] == pytest.approx(tok.norm().item(), rel=1e-12)


# ------------------------------------------------------------------------------------------ HostBalancer (streamed)

def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def _rand_grads(seed, shapes=((4, 3), (5,), (2, 2)), none_at=None):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    if none_at is not None:
        out[none_at] = None
    return out


@pytest.mark.parametrize("terms", [("sats", "vr", "hid"), ("sats",), ("hid",), ("sats", "vr"), ("sats", "hid")])
@pytest.mark.parametrize("ratio", [1.0, 0.5, 3.0])
def test_host_balancer_equals_balance_of_combine_aux(terms, ratio):
    tok, gs = _rand_grads(0), {"sats": _rand_grads(1), "vr": _rand_grads(2, none_at=1), "hid": _rand_grads(3)}
    params = [torch.nn.Parameter(torch.zeros(t.shape, dtype=torch.float64)) for t in tok]
    buffers = {("tok", 0): torch.full((4, 3), 7.0, dtype=torch.float64)}  # reused host storage of an earlier step
    hb = HostBalancer(params, ratio=ratio, rho=2.0, sync=False, buffers=buffers)
    _set(params, tok)
    hb.take_token()
    for name in [t for t in terms if t != "hid"]:
        _set(params, gs[name])
        hb.take_pooled(name)
        assert all(p.grad is None for p in params)  # each pass's gradient leaves the device
    last = "hid" if "hid" in terms else None
    if last:
        _set(params, gs["hid"])
    info = hb.finish(last)
    g_aux, ainfo = combine_aux(*(gs[t] if t in terms else None for t in ("sats", "vr", "hid")), rho=2.0, sync=False)
    ref, binfo = balance(tok, g_aux, ratio, sync=False)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-12, atol=1e-12)
    for k in ("scale", "tok_norm", "aux_norm", "cos_tok_aux", "final_norm", "fallback"):
        assert info[k] == pytest.approx(binfo[k], rel=1e-10, abs=1e-12), k
    for k in ("s_norm", "cos_u_hid", "cos_sats_vr", "sats_norm", "vr_norm", "hid_norm"):
        assert info[k] == pytest.approx(ainfo[k], rel=1e-10, abs=1e-12), k
    assert info["final_norm"] == pytest.approx(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params)), rel=1e-10)
    assert ("tok", 2) in buffers and (("s", 0) in buffers) == any(t in terms for t in ("sats", "vr"))


@pytest.mark.parametrize("other", ["vr", "hid"])
def test_host_balancer_one_one_one_equals_reference(other):
    tok, sats, oth = _rand_grads(4), _rand_grads(5), _rand_grads(6, none_at=2)
    params = [torch.nn.Parameter(torch.zeros(t.shape, dtype=torch.float64)) for t in tok]
    hb = HostBalancer(params, variant="1:1:1", sync=False)
    _set(params, tok)
    hb.take_token()
    _set(params, sats)
    hb.take_pooled("sats")
    with pytest.raises(ValueError, match="one pooled term"):
        hb.take_pooled(other)
    _set(params, oth)
    hb.finish(other)
    ref, _ = combine_one_one_one(tok, sats, oth, sync=False)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-12, atol=1e-12)


def test_host_balancer_edge_cases_match_eq9_conventions():
    tok, hid = _rand_grads(7), _rand_grads(8)
    params = [torch.nn.Parameter(torch.zeros(t.shape, dtype=torch.float64)) for t in tok]
    # aux = 0 (no region, no hidden gradient): g = g_tok
    hb = HostBalancer(params, sync=False)
    _set(params, tok)
    hb.take_token()
    _set(params, [torch.zeros_like(t) for t in tok])
    hb.take_pooled("sats")
    info = hb.finish(None)
    assert info["fallback"] == 1.0
    for p, t in zip(params, tok):
        torch.testing.assert_close(p.grad, t)
    # g_tok = 0: g = 0
    hb = HostBalancer(params, sync=False)
    _set(params, [torch.zeros_like(t) for t in tok])
    hb.take_token()
    _set(params, hid)
    info = hb.finish("hid")
    assert info["fallback"] == 2.0 and all(float(p.grad.abs().max()) == 0.0 for p in params)
    with pytest.raises(ValueError, match="take_token must come first"):
        HostBalancer(params, sync=False).take_pooled("sats")


@pytest.mark.parametrize("present", [("sats", "vr", "hid"), ("sats",), ("hid",), ("sats", "hid"), ()])
@pytest.mark.parametrize("ratio", [1.0, 0.3, 2.5])
def test_balance_fsar_equals_combine_aux_then_balance(present, ratio):
    """The one-pass Gram-matrix form used by balanced_backward: same g and info as eq. (10) then eq. (9), float64."""
    from claas_verl.align.balance import balance_fsar

    g = torch.Generator().manual_seed(3)
    shapes = [(5, 3), (7,), (2, 2, 2)]

    def grad(scale, skip=None):
        return [None if i == skip else torch.randn(s, generator=g, dtype=torch.float64) * scale
                for i, s in enumerate(shapes)]

    tok = grad(1.0)
    terms = {"sats": grad(1e-3, skip=1), "vr": grad(50.0), "hid": grad(0.2, skip=2)}
    terms = {t: (v if t in present else None) for t, v in terms.items()}
    if present:
        ref_aux, ainfo = combine_aux(terms["sats"], terms["vr"], terms["hid"], rho=2.0)
    else:  # no alignment gradient at all: g = g_tok (fallback 1)
        ref_aux, ainfo = None, dict.fromkeys(("sats_norm", "vr_norm", "hid_norm", "cos_sats_vr", "s_norm",
                                              "cos_u_hid"), 0.0)
    ref, binfo = balance(tok, ref_aux, ratio)
    got, info = balance_fsar([t.clone() for t in tok], terms["sats"], terms["vr"], terms["hid"], ratio, 2.0,
                             in_place=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    for k in ("scale", "aux_norm", "cos_tok_aux", "final_norm", "fallback", "tok_coef", "aux_coef"):
        assert info[k] == pytest.approx(binfo[k], rel=1e-10, abs=1e-14), k
    for k in ("sats_norm", "vr_norm", "hid_norm", "cos_sats_vr", "s_norm", "cos_u_hid"):
        assert info[k] == pytest.approx(ainfo[k], rel=1e-10, abs=1e-14), k
    # g is the multiplier-weighted sum of the raw gradients
    for i, ref_i in enumerate(ref):
        manual = tok[i] * info["mult_tok"]
        for t in ("sats", "vr", "hid"):
            if terms[t] is not None and terms[t][i] is not None:
                manual = manual + terms[t][i] * info[f"mult_{t}"]
        torch.testing.assert_close(manual, ref_i, rtol=1e-12, atol=1e-15)
