"""Token channel (docs/math.md §B.2) keeps the caller's precision: compute and return in promote_types(dtype, float32);
the chunked differentiable log-prob path equals the unchunked one and plain autograd, values and gradients."""

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

EXPECTED = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32}


def _logits(dtype, B=2, T=6, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    z_s = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    z_t = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    return z_s, z_t, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_and_backward_in_promoted_dtype(dtype):
    z_s, z_t, mask = _logits(dtype)
    want = EXPECTED[dtype]
    ids, S = student_topk(z_s, 5, chunk_size=4)
    Q = teacher_logprobs_at(z_t, ids, chunk_size=4)
    r = topk_rewards(S, Q, mask)
    A = domain_normalized_advantages(r, mask)
    assert S.dtype == Q.dtype == r.dtype == A.dtype == want
    assert topk_weighted_kl(S, Q, mask).dtype == want and topk_binned_kl(S, Q, mask).dtype == want
    z = z_s.clone().requires_grad_(True)
    loss = topk_distill_loss(z, ids, A, mask, chunk_size=4)
    assert loss.dtype == want
    loss.backward()  # float64 used to fail with "Float did not match Double"
    assert z.grad.dtype == dtype and torch.isfinite(z.grad.float()).all()
    # reference: the same formulas by plain autograd in float64 on the same (rounded) inputs
    z64 = z_s.double().requires_grad_(True)
    ref_logp = torch.gather(F.log_softmax(z64, -1), -1, ids)
    S64 = torch.gather(F.log_softmax(z_s.double(), -1), -1, ids)
    Q64 = torch.gather(F.log_softmax(z_t.double(), -1), -1, ids)
    A64 = domain_normalized_advantages(topk_rewards(S64, Q64, mask), mask)
    ref = -((A64 * ref_logp).sum(-1) * mask).sum() / mask.sum()
    ref.backward()
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-5}[dtype]
    torch.testing.assert_close(S.double(), S64, rtol=0, atol=tol * 10)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=tol * 10, atol=tol)
    gtol = tol if dtype != torch.bfloat16 else 1e-2  # the gradient is stored in bf16 (the logits' dtype)
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=gtol, atol=gtol * 1e-2)


def test_float64_keeps_precision_beyond_float32():
    # a logit gap of 1e-10 is invisible in float32 and must survive in float64
    z = torch.zeros(1, 1, 3, dtype=torch.float64)
    z[0, 0, 0] = 1e-10
    ids, S = student_topk(z, 2)
    assert S.dtype == torch.float64 and S[0, 0, 0] - S[0, 0, 1] == pytest.approx(1e-10, rel=1e-6)
    assert teacher_logprobs_at(z, ids)[0, 0, 0] != teacher_logprobs_at(z, ids)[0, 0, 1]


@pytest.mark.parametrize("chunk", [1, 5, 16, None])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_chunked_logprobs_equal_unchunked_and_autograd(chunk, tau):
    # N = 3·7 = 21 positions (chunks do not divide N), float64: values and gradients to 1e-12 of log_softmax
    g = torch.Generator().manual_seed(3)
    z = torch.randn(3, 7, 64, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, 64, (3, 7, 4), generator=g)
    ids[0, 0] = torch.tensor([5, 5, 9, 5])  # repeated ids accumulate like autograd's gather
    up = torch.randn(3, 7, 4, generator=g, dtype=torch.float64)
    a = z.clone().requires_grad_(True)
    lp = topk_logprobs(a, ids, temperature=tau, chunk_size=chunk)
    (lp * up).sum().backward()
    b = z.clone().requires_grad_(True)
    ref = torch.gather(F.log_softmax(b / tau, -1), -1, ids)
    (ref * up).sum().backward()
    torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    # chunked == one chunk (the unchunked path): same values, same gradients
    c = z.clone().requires_grad_(True)
    lp1 = topk_logprobs(c, ids, temperature=tau, chunk_size=None)
    (lp1 * up).sum().backward()
    torch.testing.assert_close(lp, lp1, rtol=0, atol=1e-14)
    torch.testing.assert_close(a.grad, c.grad, rtol=0, atol=1e-14)


def test_noncontiguous_logits_slice_gets_its_gradient():
    # logits[:, P-1:-1] of a prompt+response forward: the gradient lands on the sliced positions only
    g = torch.Generator().manual_seed(4)
    full = torch.randn(2, 9, 30, generator=g, dtype=torch.float64).requires_grad_(True)
    ids = torch.randint(0, 30, (2, 5, 3), generator=g)
    topk_logprobs(full[:, 3:-1], ids, chunk_size=3).sum().backward()
    ref = full.detach().clone().requires_grad_(True)
    torch.gather(F.log_softmax(ref[:, 3:-1], -1), -1, ids).sum().backward()
    torch.testing.assert_close(full.grad, ref.grad, rtol=0, atol=1e-12)
    assert torch.all(full.grad[:, :3] == 0) and torch.all(full.grad[:, -1] == 0)
