"""Chunked pooled attention rows vs a naive full-softmax reference (docs/math.md §B.4, B.5)."""

import pytest
import torch

from claas_verl.align import (
    naive_pooled_attention_rows,
    pooled_attention_rows,
    pooled_rows_loss,
    step_regions,
)


def _batch(seed, b=3, g=2, rep=2, d=8, prompt=5, resp=9, window=6, sep_p=0.25):
    """Left-padded prompts + right-padded responses, random q/k and step regions on the window."""
    gen = torch.Generator().manual_seed(seed)
    h = g * rep
    t = prompt + resp
    p_len = torch.randint(1, prompt + 1, (b,), generator=gen)
    r_len = torch.randint(1, resp + 1, (b,), generator=gen)
    ar_p, ar_r = torch.arange(prompt), torch.arange(resp)
    prompt_mask = ar_p[None, :] >= (prompt - p_len)[:, None]  # left padding
    resp_mask = ar_r[None, :] < r_len[:, None]  # right padding
    resp_ids = torch.where(torch.rand(b, resp, generator=gen) < sep_p, 1, 0)  # id 1 is the separator
    regions = step_regions(resp_ids, resp_mask.long(), {1}, window=window).pad_left(prompt)
    key_mask = torch.cat([prompt_mask, resp_mask], 1).long()
    q = torch.randn(b, h, t, d, generator=gen)
    k = torch.randn(b, g, t, d, generator=gen)
    return q, k, key_mask, regions


CASES = [
    dict(seed=0),
    dict(seed=1, g=1, rep=3, d=4),  # MQA-like
    dict(seed=2, g=3, rep=1),  # no repetition
    dict(seed=3, window=2000),  # window longer than every response
    dict(seed=4, window=1, b=2),  # one-token windows
    dict(seed=5, sep_p=0.0),  # one region per response, ending without a separator
    dict(seed=6, sep_p=0.9, b=4, resp=12, window=10),  # many regions, some ending on separators
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_matches_naive(case, chunk):
    q, k, key_mask, reg = _batch(**case)
    fast = pooled_attention_rows(q, k, key_mask, reg.region_ids, reg.num_regions, chunk_size=chunk)
    ref = naive_pooled_attention_rows(q, k, key_mask, reg.region_ids, reg.num_regions)
    assert fast.key_start == ref.key_start
    assert fast.rows.shape == ref.rows.shape
    assert (fast.rows - ref.rows).abs().max() <= 2e-6
    # every pooled row is a mean of probability rows: it sums to 1 on real regions, 0 elsewhere
    r_max = fast.rows.shape[2]
    real_region = torch.arange(r_max)[None, :] < reg.num_regions[:, None]
    sums = fast.rows.sum(-1)  # [B, H, R]
    assert torch.allclose(sums, real_region[:, None].float().expand_as(sums), atol=1e-5)
    # padding keys never receive attention
    pad_keys = ~key_mask[:, fast.key_start :].bool()[:, : fast.rows.shape[-1]]
    assert fast.rows.masked_select(pad_keys[:, None, None, :].expand_as(fast.rows)).abs().sum() == 0


def test_batched_equals_per_sample():
    q, k, key_mask, reg = _batch(seed=11, b=3)
    full = pooled_attention_rows(q, k, key_mask, reg.region_ids, reg.num_regions, chunk_size=4)
    for i in range(3):
        one = pooled_attention_rows(q[i : i + 1], k[i : i + 1], key_mask[i : i + 1], reg.region_ids[i : i + 1],
                                    reg.num_regions[i : i + 1], chunk_size=4)
        n_r, off = int(reg.num_regions[i]), one.key_start - full.key_start
        tk = one.rows.shape[-1]
        assert torch.equal(full.rows[i, :, :n_r, :off], torch.zeros_like(full.rows[i, :, :n_r, :off]))
        assert (full.rows[i, :, :n_r, off : off + tk] - one.rows[0, :, :n_r]).abs().max() <= 2e-6
        assert full.rows[i, :, :n_r, off + tk :].abs().sum() == 0  # beyond this response's t_last


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[6]])
def test_gradient_chunked_equals_naive(case):
    q, k, key_mask, reg = _batch(**case)
    w = torch.randn(naive_pooled_attention_rows(q, k, key_mask, reg.region_ids, reg.num_regions).rows.shape)
    grads = []
    for fn in (lambda *a: pooled_attention_rows(*a, chunk_size=3), naive_pooled_attention_rows):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        (fn(qq, kk, key_mask, reg.region_ids, reg.num_regions).rows * w).sum().backward()
        grads.append((qq.grad, kk.grad))
    for a, b in zip(grads[0], grads[1]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert grads[0][0].abs().sum() > 0 and grads[0][1].abs().sum() > 0


def test_recomputation_stores_no_attention_matrix():
    # Bytes saved for backward (distinct storages) must stay below a quarter of ONE full
    # [B, H, Wq, Tk] probability matrix; without recomputation the chunks together save all of it.
    q, k, key_mask, reg = _batch(seed=7, b=2, d=4, prompt=40, resp=120, window=100)
    q.requires_grad_()
    k.requires_grad_()
    saved = {}

    def pack(x):
        st = x.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = pooled_attention_rows(q, k, key_mask, reg.region_ids, reg.num_regions, chunk_size=8)
    wq = int((reg.region_ids >= 0).sum(-1).max())
    full = q.shape[0] * q.shape[1] * wq * out.rows.shape[-1] * 4
    assert sum(saved.values()) < full / 4
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        pooled_attention_rows(q, k, key_mask, reg.region_ids, reg.num_regions, chunk_size=8, recompute=False)
    assert sum(saved.values()) >= full  # the check above can fail


def test_no_region_gives_zero_loss_and_zero_grad():
    q, k, key_mask, reg = _batch(seed=8, b=2)
    none = torch.full_like(reg.region_ids, -1)
    zero = torch.zeros_like(reg.num_regions)
    q.requires_grad_()
    k.requires_grad_()
    s = pooled_attention_rows(q, k, key_mask, none, zero)
    t = pooled_attention_rows(q.detach() + 1, k.detach(), key_mask, none, zero)
    assert s.rows.shape[2] == 0
    val = pooled_rows_loss([s], [t], zero)
    val.loss.backward()
    assert val.loss.item() == 0.0 and val.count == 0 and val.n_responses == 2
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))


def test_bad_inputs_raise():
    q, k, key_mask, reg = _batch(seed=9)
    with pytest.raises(ValueError, match="multiple"):
        pooled_attention_rows(q[:, :3], k, key_mask, reg.region_ids, reg.num_regions)
    bad = reg.region_ids.clone()
    bad[key_mask == 0] = 0
    with pytest.raises(ValueError, match="padding"):
        pooled_attention_rows(q, k, key_mask, bad, reg.num_regions)


def test_rows_stay_fp32_inside_bf16_autocast():
    """loss math in fp32 (docs/math.md §0), also inside the engine's bf16 autocast (where the alignment passes run). A
    teacher
    0.05% away from the student (a replay snapshot) must give the fp32 SATS distance; with bf16 matmuls the rows
    were off by ~0.6% and that distance came out 12x too large (d = 64, scores of a few units)."""
    gen = torch.Generator().manual_seed(0)
    b, g, rep, d, prompt, resp = 2, 2, 2, 64, 40, 40
    key_mask = torch.ones(b, prompt + resp, dtype=torch.long)
    sep = torch.where(torch.rand(b, resp, generator=gen) < 0.2, 1, 0)
    reg = step_regions(sep, torch.ones(b, resp, dtype=torch.long), {1}, window=32).pad_left(prompt)
    q = (torch.randn(b, g * rep, prompt + resp, d, generator=gen) * 1.5).requires_grad_()
    k = torch.randn(b, g, prompt + resp, d, generator=gen) * 1.5
    q_t = q.detach() * (1 + 5e-4 * torch.randn(q.shape, generator=gen))
    k_t = k * (1 + 5e-4 * torch.randn(k.shape, generator=gen))

    def sats(chunk):
        s = pooled_attention_rows(q, k, key_mask, reg.region_ids, reg.num_regions, chunk_size=chunk)
        t = pooled_attention_rows(q_t, k_t, key_mask, reg.region_ids, reg.num_regions, chunk_size=chunk)
        return s.rows, pooled_rows_loss([s], [t], reg.num_regions).loss

    rows_ref, loss_ref = sats(16)
    naive = naive_pooled_attention_rows(q.detach(), k, key_mask, reg.region_ids, reg.num_regions).rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows_ac, loss_ac = sats(16)
        naive_ac = naive_pooled_attention_rows(q.detach(), k, key_mask, reg.region_ids, reg.num_regions).rows
    assert rows_ac.dtype == torch.float32
    assert float((rows_ac - rows_ref).norm() / rows_ref.norm()) <= 1e-6
    assert float((naive_ac - naive).norm() / naive.norm()) <= 1e-6
    assert float(loss_ac) == pytest.approx(float(loss_ref), rel=1e-4) and float(loss_ref) > 0
    # backward outside autocast, as the trainer runs it; the checkpointed chunks recompute under the saved
    # (enabled) autocast state and must still be fp32
    (grad_ref,) = torch.autograd.grad(loss_ref, q)
    (grad_ac,) = torch.autograd.grad(loss_ac, q)
    torch.testing.assert_close(grad_ac, grad_ref, rtol=1e-4, atol=1e-6 * float(grad_ref.abs().max()))
