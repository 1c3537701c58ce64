"""docs/math.md §A.2: sequence-level IS clipped loss, hand-derived values, gradients, clip branches, sharding."""

import math

import pytest
import torch

from claas_verl.losses import behaviour_seq_logprob, seq_is_clipped_loss, sequence_log_ratio
from claas_verl.utils.masked import LOSS_AGG_MODES

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# row 0: Σ logp = -3;   row 1: Σ logp = -1 (the padding value 7.0 must never matter)
LOGP = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, 7.0]])
# behaviour ℓb placed on ONE valid position per row: row 0 ℓb = -3.3, row 1 ℓb = -0.4
OLD_ONE_POS = torch.tensor([[-3.3, 0.0, 0.0], [0.0, -0.4, 0.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])


def test_geo_mean_hand_values_and_metrics():
    # row 0: Δ = -3 - (-3.3) = 0.3, n = 3 → logρ = 0.1, ρ = e^0.1 = 1.105171 ∈ [0.8, 1.2], A=+1 → L = -1.105171
    # row 1: Δ = -1 - (-0.4) = -0.6, n = 2 → logρ = -0.3, ρ = e^-0.3 = 0.740818 < 0.8, A=-1:
    #        L1 = 0.740818, L2 = 0.8 → Lc = 0.8 (low clip); dual: min(0.8, -3·A = 3) = 0.8
    # token-mean: (3·(-1.105171) + 2·0.8) / 5 = (-3.315513 + 1.6) / 5 = -0.343103
    loss, m = seq_is_clipped_loss(LOGP, OLD_ONE_POS, ADV, MASK, ratio_mode="geo_mean")
    assert loss.item() == pytest.approx((3 * -math.exp(0.1) + 2 * 0.8) / 5, abs=1e-6)
    assert loss.item() == pytest.approx(-0.343103, abs=1e-6)
    assert m["actor/pg_clipfrac_low"] == pytest.approx(2 / 5)  # the 2 tokens of row 1
    assert m["actor/pg_clipfrac_high"] == 0.0
    assert m["actor/pg_clipfrac_dual"] == 0.0
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["actor/seq_ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.3)) / 2, abs=1e-6)
    assert m["actor/seq_ratio_max"] == pytest.approx(math.exp(0.1), abs=1e-6)
    assert m["actor/seq_ratio_outside_trust_frac"] == pytest.approx(0.5)  # row 1 only
    # 0-dim detached tensors (no host read per metric); the caller reduces them once per step
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in m.values())


def test_product_hand_values_high_clip():
    # row 0: logρ = Δ = 0.3, ρ = 1.349859 > 1.2, A=+1: L1 = -1.349859, L2 = -1.2 → L = -1.2 (high clip)
    # row 1: logρ = -0.6, ρ = 0.548812 < 0.8, A=-1: L = max(0.548812, 0.8) = 0.8 (low clip)
    # token-mean: (3·(-1.2) + 2·0.8) / 5 = -2.0 / 5 = -0.4
    loss, m = seq_is_clipped_loss(LOGP, OLD_ONE_POS, ADV, MASK, ratio_mode="product")
    assert loss.item() == pytest.approx(-0.4, abs=1e-6)
    assert m["actor/pg_clipfrac_high"] == pytest.approx(3 / 5)
    assert m["actor/pg_clipfrac_low"] == pytest.approx(2 / 5)
    assert m["actor/seq_ratio_outside_trust_frac"] == pytest.approx(1.0)


def test_dual_clip_branch_and_its_zero_gradient():
    # one row, n = 2, Δ = 3 → geo logρ = 1.5, ρ = e^1.5 = 4.481689; A = -1:
    # L1 = 4.481689, L2 = -A·1.2 = 1.2 → Lc = 4.481689 > -c·A = 3 → L = 3 (dual clip), gradient 0.
    logp = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-2.0, -2.0]])
    adv = torch.tensor([[-1.0, -1.0]])
    loss, m = seq_is_clipped_loss(logp, old, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(3.0)
    assert m["actor/pg_clipfrac_dual"] == pytest.approx(1.0)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1.0)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    # dual clip off: L = Lc = e^1.5 and the gradient is -A·ρ/N = e^1.5/2 per token (unclipped L1 branch)
    logp.grad = None
    loss, m = seq_is_clipped_loss(logp, old, adv, torch.ones(1, 2), clip_ratio_c=None)
    assert loss.item() == pytest.approx(math.exp(1.5), abs=1e-5)
    assert m["actor/pg_clipfrac_dual"] == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), math.exp(1.5) / 2), atol=1e-5)


@pytest.mark.parametrize("ratio_mode", ["geo_mean", "product"])
def test_rho_one_gradient_equals_reinforce(ratio_mode):
    # ℓb recomputed at the current θ → ρ = 1 → ∇L = ∇( -Σ m·A·logp / N_tok ), the plain REINFORCE gradient.
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5, requires_grad=True)
    ids = torch.randint(0, 5, (3, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv = torch.randn(3, 1).expand(3, 4).contiguous()

    def logp_fn():
        return torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    loss, m = seq_is_clipped_loss(logp_fn(), logp_fn().detach(), adv, mask, ratio_mode=ratio_mode)
    (g_is,) = torch.autograd.grad(loss, logits)
    reinforce = -(adv * logp_fn() * mask).sum() / mask.sum()
    (g_pg,) = torch.autograd.grad(reinforce, logits)
    assert torch.allclose(g_is, g_pg, atol=1e-6)
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / 7, abs=1e-6)  # ρ = 1 in the value too
    assert m["actor/seq_ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_unclipped_gradient_is_rho_times_grad_logp():
    # ρ = e^0.1 inside the trust region, A = 2: ∂L/∂logp[j] = -A·ρ/N = -2·e^0.1/3 on each valid token.
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    loss, _ = seq_is_clipped_loss(logp, torch.tensor([-3.3]), torch.full((1, 3), 2.0), torch.ones(1, 3))
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -2 * math.exp(0.1) / 3), atol=1e-6)


def test_product_equals_geo_mean_for_one_token_responses():
    torch.manual_seed(1)
    mask = torch.zeros(6, 4)
    mask[torch.arange(6), torch.tensor([0, 1, 2, 3, 0, 2])] = 1
    old = torch.randn(6, 4) * 0.2 - 1
    adv = torch.randn(6, 1).expand(6, 4).contiguous()
    out = {}
    for mode in ("geo_mean", "product"):
        logp = (torch.randn(6, 4, generator=torch.Generator().manual_seed(2)) * 0.2 - 1).requires_grad_()
        loss, _ = seq_is_clipped_loss(logp, old, adv, mask, ratio_mode=mode)
        loss.backward()
        out[mode] = (loss.item(), logp.grad.clone())
    assert out["geo_mean"][0] == pytest.approx(out["product"][0], abs=1e-7)
    assert torch.allclose(out["geo_mean"][1], out["product"][1], atol=1e-7)


def test_old_log_prob_forms_are_equivalent():
    per_token = torch.tensor([[-1.1, -1.1, -1.1], [-0.2, -0.2, 99.0]])  # padding value ignored
    per_seq = torch.tensor([-3.3, -0.4])
    assert torch.allclose(behaviour_seq_logprob(per_token, MASK), per_seq)
    losses = [seq_is_clipped_loss(LOGP, old, ADV, MASK)[0].item() for old in (per_token, OLD_ONE_POS, per_seq)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and losses[1] == pytest.approx(losses[2], abs=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("ratio_mode", ["geo_mean", "product"])
def test_sharding_invariance_two_dp_ranks(mode, ratio_mode):
    # Each rank holds half the rows, passes the GLOBAL normalisers and dp_size=2; gradient averaging
    # over ranks is (g_0 + g_1)/2, so (loss_0 + loss_1)/2 must equal the unsharded loss.
    torch.manual_seed(3)
    B, T = 6, 5
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])
    mask = (torch.arange(T) < lengths[:, None]).float()
    logp = (torch.randn(B, T) * 0.1 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T) * 0.1
    adv = torch.randn(B, 1).expand(B, T).contiguous()
    full, _ = seq_is_clipped_loss(logp, old, adv, mask, ratio_mode=ratio_mode, loss_agg_mode=mode)
    (g_full,) = torch.autograd.grad(full, logp)
    kw = dict(global_tokens=mask.sum(), global_seqs=float(B), dp_size=2, horizon=T)
    shards = [
        seq_is_clipped_loss(logp[i:i + 3], old[i:i + 3], adv[i:i + 3], mask[i:i + 3], ratio_mode=ratio_mode,
                            loss_agg_mode=mode, **kw)[0]
        for i in (0, 3)
    ]
    avg = (shards[0] + shards[1]) / 2
    (g_avg,) = torch.autograd.grad(avg, logp)
    assert avg.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(g_avg, g_full, atol=1e-7)


def test_empty_mask_gives_zero_loss_and_finite_grad(monkeypatch):
    monkeypatch.setenv("CLAAS_VERL_DEBUG_CHECKS", "1")  # the value checks must not see padding either
    logp = torch.full((2, 3), float("nan")).requires_grad_()  # NaN everywhere, but nothing is valid
    loss, m = seq_is_clipped_loss(logp, torch.full((2, 3), float("inf")), torch.full((2, 3), float("nan")),
                                  torch.zeros(2, 3))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))
    assert m["actor/seq_ratio_mean"] == 0.0 and m["actor/pg_clipfrac"] == 0.0


def test_nan_on_padding_is_harmless(monkeypatch):
    monkeypatch.setenv("CLAAS_VERL_DEBUG_CHECKS", "1")  # the value checks must not see padding either
    logp = LOGP.clone()
    logp[1, 2] = float("nan")
    logp.requires_grad_()
    adv = ADV.clone()
    adv[1, 2] = float("inf")
    loss, _ = seq_is_clipped_loss(logp, OLD_ONE_POS, adv, MASK)
    loss.backward()
    assert loss.item() == pytest.approx(-0.343103, abs=1e-6)
    assert bool(torch.isfinite(logp.grad).all())


@pytest.mark.parametrize("field", ["log_prob", "old_log_prob", "advantages"])
def test_nan_on_valid_position_raises(field, monkeypatch):
    monkeypatch.setenv("CLAAS_VERL_DEBUG_CHECKS", "1")  # value checks are host reads: debug flag only
    args = {"log_prob": LOGP.clone(), "old_log_prob": OLD_ONE_POS.clone(), "advantages": ADV.clone()}
    args[field][0, 0] = float("nan")
    with pytest.raises(ValueError, match=field):
        seq_is_clipped_loss(args["log_prob"], args["old_log_prob"], args["advantages"], MASK)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="ratio_mode"):
        sequence_log_ratio(LOGP, OLD_ONE_POS, MASK, "per_token")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        seq_is_clipped_loss(LOGP, OLD_ONE_POS, ADV, MASK, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        seq_is_clipped_loss(LOGP, OLD_ONE_POS, ADV, MASK, clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        seq_is_clipped_loss(LOGP, OLD_ONE_POS, ADV, MASK, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="shape"):
        seq_is_clipped_loss(LOGP, OLD_ONE_POS, ADV[:, :2], MASK)


def test_token_weights_scale_the_token_loss():
    # rollout_is_weights = 2 on row 0 only: (2·3·(-e^0.1) + 2·0.8)/5
    w = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    loss, _ = seq_is_clipped_loss(LOGP, OLD_ONE_POS, ADV, MASK, token_weights=w)
    assert loss.item() == pytest.approx((6 * -math.exp(0.1) + 1.6) / 5, abs=1e-6)


def test_product_log_ratio_clamp_and_geo_token_clamp():
    # product: Δ = 30 is clamped to 20; geo_mean: logρ = 30/1 is clamped to 10 on the token ratio.
    logp = torch.tensor([[0.0]])
    old = torch.tensor([[-30.0]])
    assert sequence_log_ratio(logp, old, torch.ones(1, 1), "product").item() == 20.0
    _, m = seq_is_clipped_loss(logp, old, torch.ones(1, 1), torch.ones(1, 1), ratio_mode="geo_mean")
    assert m["actor/seq_ratio_max"] == pytest.approx(math.exp(10.0), rel=1e-6)
