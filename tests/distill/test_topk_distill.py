"""Token channel (docs/math.md §B.2): top-k, teacher log-probs, rewards, loss, the B.2.4 gradient identity, chunking."""

import math

import pytest
import torch
import torch.nn.functional as F

from claas_verl.distill import (
    domain_normalized_advantages,
    student_topk,
    teacher_logprobs_at,
    topk_binned_kl,
    topk_distill_loss,
    topk_logprobs,
    topk_rewards,
    topk_weighted_kl,
)


def _setup(B=2, T=5, V=40, K=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    z_s = torch.randn(B, T, V, generator=g) * 2
    z_t = torch.randn(B, T, V, generator=g) * 2
    mask = torch.ones(B, T)
    if B > 1:
        mask[1, 3:] = 0  # padding at the end of response 1
    return z_s, z_t, mask, K


def test_student_topk_is_full_vocab_and_sorted():
    z_s, _, _, K = _setup()
    ids, logp = student_topk(z_s, K, chunk_size=None)
    full = F.log_softmax(z_s, -1)
    assert ids.shape == (2, 5, K) and logp.dtype == torch.float32
    torch.testing.assert_close(logp, torch.gather(full, -1, ids), rtol=0, atol=1e-6)
    assert torch.all(logp[..., :-1] >= logp[..., 1:])
    # the k largest: every non-selected log-prob is <= the smallest selected one
    rest = full.scatter(-1, ids, float("-inf"))
    assert torch.all(rest.max(-1).values <= logp[..., -1])


def test_teacher_logprobs_are_full_vocab_not_renormalised():
    z_s, z_t, _, K = _setup()
    ids, _ = student_topk(z_s, K)
    Q = teacher_logprobs_at(z_t, ids)
    expected = torch.gather(F.log_softmax(z_t.float(), -1), -1, ids)
    torch.testing.assert_close(Q, expected, rtol=0, atol=1e-6)
    # renormalising over the k would make Σ exp Q = 1; the full-vocabulary values sum to < 1 (V=40 > K=6)
    mass = Q.exp().sum(-1)
    assert torch.all(mass < 0.999)


def test_temperature_divides_logits():
    z_s, z_t, _, K = _setup()
    ids, logp = student_topk(z_s, K, temperature=0.7)
    torch.testing.assert_close(logp, torch.gather(F.log_softmax(z_s.float() / 0.7, -1), -1, ids), rtol=0, atol=1e-6)
    Q = teacher_logprobs_at(z_t, ids, temperature=0.7)
    torch.testing.assert_close(Q, torch.gather(F.log_softmax(z_t.float() / 0.7, -1), -1, ids), rtol=0, atol=1e-6)


def test_rewards_hand_computed():
    # one position, k=2: S = log(0.5), log(0.25) -> w = (2/3, 1/3); Q = log(0.25), log(0.25)
    # r = w·(Q − S) = (2/3·log(0.5), 1/3·0) = (−0.462098..., 0)
    S = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    Q = torch.tensor([[[math.log(0.25), math.log(0.25)]]])
    r = topk_rewards(S, Q, torch.ones(1, 1))
    torch.testing.assert_close(r, torch.tensor([[[2 / 3 * math.log(0.5), 0.0]]], dtype=torch.float32))
    # weighted KL = Σ w (S − Q) = −Σ r = 0.462098
    assert topk_weighted_kl(S, Q, torch.ones(1, 1)).item() == pytest.approx(-2 / 3 * math.log(0.5), rel=1e-6)


def test_binned_kl_hand_computed():
    # p = (0.5, 0.25 | tail 0.25), q = (0.25, 0.25 | tail 0.5):
    # 0.5·log 2 + 0.25·log 1 + 0.25·log(0.25/0.5) = 0.25·log 2 = 0.173287...
    S = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    Q = torch.tensor([[[math.log(0.25), math.log(0.25)]]])
    assert topk_binned_kl(S, Q, torch.ones(1, 1)).item() == pytest.approx(0.25 * math.log(2), rel=1e-6)


def test_binned_kl_is_a_lower_bound_of_the_full_kl_and_exact_at_full_k():
    torch.manual_seed(0)
    B, T, V = 3, 5, 12
    z_s, z_t = torch.randn(B, T, V) * 2, torch.randn(B, T, V) * 2
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    log_p, log_q = F.log_softmax(z_s, -1), F.log_softmax(z_t, -1)
    full = ((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum() / mask.sum()
    previous = -1.0
    for K in (1, 3, 6, V):
        ids, S = student_topk(z_s, K)
        binned = topk_binned_kl(S, teacher_logprobs_at(z_t, ids), mask).item()
        assert 0.0 <= binned <= full.item() * (1 + 1e-5)
        assert binned >= previous * (1 - 1e-5)  # refining the bins (a larger top-k) never lowers it
        previous = binned
    assert previous == pytest.approx(full.item(), rel=1e-5)  # K = V: no tail, the full KL


def test_binned_kl_stays_non_negative_where_the_renormalised_topk_kl_does_not():
    # p = (0.5, 0.25 | 0.25), q = (0.6, 0.3 | 0.1): the teacher is MORE confident on both student candidates.
    # weighted: 2/3·log(5/6) + 1/3·log(5/6) = log(5/6) < 0; binned: 0.75·log(5/6) + 0.25·log(2.5) = 0.092330...
    S = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    Q = torch.tensor([[[math.log(0.6), math.log(0.3)]]])
    one = torch.ones(1, 1)
    assert topk_weighted_kl(S, Q, one).item() == pytest.approx(math.log(5 / 6), rel=1e-6)
    assert topk_binned_kl(S, Q, one).item() == pytest.approx(0.75 * math.log(5 / 6) + 0.25 * math.log(2.5), rel=1e-5)


def test_reward_zero_when_teacher_equals_student_and_zero_on_padding():
    z_s, _, mask, K = _setup()
    ids, S = student_topk(z_s, K)
    Q = teacher_logprobs_at(z_s, ids)  # q = p
    assert torch.all(topk_rewards(S, Q, mask) == 0)
    _, z_t, _, _ = _setup(seed=1)
    r = topk_rewards(S, teacher_logprobs_at(z_t, ids), mask)
    assert torch.all(r[1, 3:] == 0) and torch.any(r[0] != 0)


def test_nonfinite_teacher_logprob_raises():
    S = torch.zeros(1, 1, 2)
    Q = torch.tensor([[[0.0, float("-inf")]]])
    with pytest.raises(ValueError, match="non-finite"):
        topk_rewards(S, Q, torch.ones(1, 1))
    # ...but a -inf on padding is fine
    topk_rewards(S, Q, torch.zeros(1, 1))


def test_bad_ids_name_the_argument():
    z_s, z_t, _, K = _setup()
    ids, _ = student_topk(z_s, K)
    with pytest.raises(ValueError, match="vocabulary"):
        teacher_logprobs_at(z_t[..., :10], ids.clamp(min=10))
    with pytest.raises(ValueError, match="ids must be"):
        teacher_logprobs_at(z_t, ids[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        student_topk(z_s, K, chunk_size=0)


def _step_quantities(z_s, z_t, mask, K):
    ids, S = student_topk(z_s, K)
    Q = teacher_logprobs_at(z_t, ids)
    r = topk_rewards(S, Q, mask)
    return ids, S, Q, r


def test_gradient_identity_B24_per_token():
    """∇_z[−Σ_v A log p_v] = (1/(σ P_t)) ∇_z D_t at θ_old, D_t = Σ_{v∈V_t} p log(p/q) − p + q."""
    z_s, z_t, mask, K = _setup(B=1, T=4, V=30, K=5, seed=3)
    mask = torch.ones(1, 4)
    ids, S, Q, r = _step_quantities(z_s, z_t, mask, K)
    A = domain_normalized_advantages(r, mask).double()
    r64 = r.double()
    sigma = r64.flatten().std()  # one domain, ddof=1 over all 4·5 candidates
    for t in range(4):
        z = z_s[0, t].double().requires_grad_(True)
        logp = F.log_softmax(z, -1)[ids[0, t]]
        (g_loss,) = torch.autograd.grad(-(A[0, t] * logp).sum(), z)
        z2 = z_s[0, t].double().requires_grad_(True)
        p = F.softmax(z2, -1)[ids[0, t]]
        q = Q[0, t].double().exp()
        D = (p * torch.log(p / q) - p + q).sum()
        (g_D,) = torch.autograd.grad(D, z2)
        P = S[0, t].double().exp().sum()
        torch.testing.assert_close(g_loss, g_D / (sigma * P), rtol=1e-5, atol=1e-8)


def test_gradient_identity_batch_form_through_topk_distill_loss():
    """∇ℓ_tok = (1/N) Σ_t ∇D_t/(σ P_t) with N = Σm, through the public loss (token-mean, padding ignored)."""
    z_s, z_t, mask, K = _setup(B=2, T=5, V=40, K=6, seed=4)
    ids, S, Q, r = _step_quantities(z_s, z_t, mask, K)
    A = domain_normalized_advantages(r, mask)
    sigma = r[mask.bool()].double().flatten().std()
    z = z_s.clone().requires_grad_(True)
    (g_loss,) = torch.autograd.grad(topk_distill_loss(z, ids, A, mask, chunk_size=3), z)

    z2 = z_s.double().requires_grad_(True)
    p = torch.gather(F.softmax(z2, -1), -1, ids)
    q = Q.double().exp()
    D = (p * torch.log(p / q) - p + q).sum(-1)  # [B, T]
    P = S.double().exp().sum(-1)
    N = mask.sum()
    target = (D / (sigma * P) * mask).sum() / N
    (g_D,) = torch.autograd.grad(target, z2)
    # loss math is fp32 (docs/math.md §0): compare at fp32 precision
    torch.testing.assert_close(g_loss.double(), g_D, rtol=1e-4, atol=1e-7)
    assert torch.all(g_loss[1, 3:] == 0)  # padding gets no gradient


def test_mean_subtracted_advantages_break_the_identity():
    z_s, z_t, mask, K = _setup(B=1, T=6, V=30, K=5, seed=5)
    mask = torch.ones(1, 6)
    ids, S, Q, r = _step_quantities(z_s, z_t, mask, K)
    sigma = r.double().flatten().std()
    A_good = r.double() / sigma
    A_bad = (r.double() - r.double().mean()) / sigma  # whitening, as GRPO would
    z = z_s.double().requires_grad_(True)
    logp = torch.gather(F.log_softmax(z, -1), -1, ids)
    (g_good,) = torch.autograd.grad(-(A_good * logp).sum(), z, retain_graph=True)
    (g_bad,) = torch.autograd.grad(-(A_bad * logp).sum(), z)
    z2 = z_s.double().requires_grad_(True)
    p = torch.gather(F.softmax(z2, -1), -1, ids)
    q = Q.double().exp()
    D = ((p * torch.log(p / q) - p + q).sum(-1) / (sigma * S.double().exp().sum(-1))).sum()
    (g_D,) = torch.autograd.grad(D, z2)
    torch.testing.assert_close(g_good, g_D, rtol=1e-5, atol=1e-8)
    rel_dev = (g_bad - g_D).norm() / g_D.norm()
    assert rel_dev > 0.05, f"mean subtraction should change the gradient materially; relative deviation {rel_dev}"


def test_generalised_kl_minimum_at_q_equals_p():
    # D_t ≥ 0 with equality at q = p on V_t: perturbing q away from p raises D
    p = torch.tensor([0.4, 0.3, 0.1])
    for q in (p, p * 1.1, p * 0.8, torch.tensor([0.3, 0.35, 0.12])):
        D = (p * torch.log(p / q) - p + q).sum()
        assert D >= -1e-15
    assert (p * torch.log(p / p) - p + p).sum() == 0


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_equals_unchunked_values_and_grads(chunk):
    z_s, z_t, mask, K = _setup(B=2, T=5, V=40, K=6, seed=6)
    ids_a, S_a = student_topk(z_s, K, chunk_size=None)
    ids_b, S_b = student_topk(z_s, K, chunk_size=chunk)
    assert torch.equal(ids_a, ids_b) and torch.equal(S_a, S_b)
    Q_a, Q_b = teacher_logprobs_at(z_t, ids_a, chunk_size=None), teacher_logprobs_at(z_t, ids_a, chunk_size=chunk)
    torch.testing.assert_close(Q_a, Q_b, rtol=0, atol=0)
    A = domain_normalized_advantages(topk_rewards(S_a, Q_a, mask), mask)
    za = z_s.clone().requires_grad_(True)
    zb = z_s.clone().requires_grad_(True)
    la = topk_distill_loss(za, ids_a, A, mask, chunk_size=None)
    lb = topk_distill_loss(zb, ids_a, A, mask, chunk_size=chunk)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(za.grad, zb.grad, rtol=1e-6, atol=1e-8)


def test_loss_hand_value_and_global_tokens_passthrough():
    # B=1,T=2,K=1; logits make log π(id) = log(1/2) at t=0 and log(1/4)... use V=2 and V=4-like logits
    z = torch.tensor([[[0.0, 0.0, -1e9, -1e9], [0.0, 0.0, 0.0, 0.0]]], dtype=torch.float32)
    ids = torch.tensor([[[0], [1]]])
    A = torch.tensor([[[2.0], [1.0]]])
    mask = torch.ones(1, 2)
    # per token: −A log π = −2·log(1/2) = 2 log 2, −1·log(1/4) = 2 log 2 ; token-mean = 2 log 2
    loss = topk_distill_loss(z, ids, A, mask)
    assert loss.item() == pytest.approx(2 * math.log(2), rel=1e-6)
    # sharded: this micro-batch holds 2 of 8 global tokens on one of 2 ranks -> sum/8·2 = 4 log 2 · 2/8
    loss_g = topk_distill_loss(z, ids, A, mask, global_tokens=8, dp_size=2)
    assert loss_g.item() == pytest.approx(4 * math.log(2) / 8 * 2, rel=1e-6)


def test_topk_logprobs_no_grad_path_matches():
    z_s, _, _, K = _setup()
    ids, S = student_topk(z_s, K)
    torch.testing.assert_close(topk_logprobs(z_s, ids, chunk_size=4), S, rtol=0, atol=1e-6)


def _saved_bytes_outside(logits, fn):
    """Bytes autograd keeps for backward in tensors that do not share the logits' own storage."""
    base = logits.untyped_storage().data_ptr()
    sizes = []

    def pack(t):
        if t.untyped_storage().data_ptr() != base:
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def test_loss_keeps_no_full_vocab_copy_for_backward():
    # N = 2·8 = 16 positions, V = 2000: an fp32 [N, V] log-softmax would be 128 000 bytes. With checkpointed
    # chunks the graph keeps only [N, K]-sized tensors (a few hundred bytes each).
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 8, 2000, generator=g).requires_grad_(True)
    ids, _ = student_topk(logits.detach(), 4)
    A = torch.randn(2, 8, 4, generator=g)
    mask = torch.ones(2, 8)
    chunked = _saved_bytes_outside(logits, lambda: topk_distill_loss(logits, ids, A, mask, chunk_size=4))
    assert chunked < 2 * 8 * 2000 * 4 / 20
    # the same measurement sees the full copy when the loss is written naively
    naive = _saved_bytes_outside(
        logits, lambda: -(A * torch.gather(F.log_softmax(logits.float() * 1.0, -1), -1, ids)).sum()
    )
    assert naive >= 2 * 8 * 2000 * 4


class _OverwritesLogitsInBackward(torch.autograd.Function):
    """Another consumer of the logits whose backward writes its gradient into the logits' own storage, the way
    flash-attn's cross-entropy with ``inplace_backward=True`` does (a raw write autograd's version counter misses)."""

    @staticmethod
    def forward(ctx, logits):
        ctx.save_for_backward(logits)
        return logits.logsumexp(-1)

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        logits.data.copy_(torch.softmax(logits, -1) * grad[..., None])
        return logits


@pytest.mark.parametrize("overwrite_first", [True, False])
def test_logits_overwritten_before_the_backward_are_refused_not_used(overwrite_first):
    z_s, _, _, K = _setup(seed=11)
    ids, _ = student_topk(z_s, K)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(12))
    leaf = z_s.clone().requires_grad_(True)
    logits = leaf * 1.0  # a model output: the leaf keeps its values whatever is written into this tensor
    # autograd runs the later-created of two ready nodes first
    if not overwrite_first:
        other = _OverwritesLogitsInBackward.apply(logits)
    lp = topk_logprobs(logits, ids, chunk_size=3)
    if overwrite_first:
        other = _OverwritesLogitsInBackward.apply(logits)
    loss = (lp * w).sum() + other.sum()
    if overwrite_first:
        with pytest.raises(RuntimeError, match="distillation_only=True"):
            loss.backward()
        return
    loss.backward()
    reference = leaf.detach().clone().requires_grad_(True)
    ((torch.log_softmax(reference, -1).gather(-1, ids) * w).sum() + reference.logsumexp(-1).sum()).backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-5, atol=1e-6)
