"""Per-domain normalised advantages (docs/math.md §B.2.2): hand-computed σ_d, fallbacks, sharding across ranks."""

import math

import pytest
import torch

from claas_verl.distill import (
    domain_advantages_and_stds,
    domain_moments,
    domain_normalized_advantages,
    domain_stds,
    stds_from_moments,
)


def _mixed_batch():
    # 3 responses, T=2, K=2. Response 0 and 2 are domain 0 (math), response 1 is domain 3 (safety).
    r = torch.tensor(
        [
            [[1.0, 3.0], [5.0, 7.0]],  # domain 0, both positions valid
            [[2.0, 4.0], [100.0, 100.0]],  # domain 3, second position is padding
            [[9.0, 11.0], [-50.0, -50.0]],  # domain 0, second position is padding
        ]
    )
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    return r, mask, torch.tensor([0, 3, 0])


def test_per_domain_std_hand_computed():
    r, mask, dom = _mixed_batch()
    # domain 0 values: {1,3,5,7,9,11}: mean 6, squared deviations 25+9+1+1+9+25 = 70, var = 70/5 = 14, σ = √14
    # domain 3 values: {2,4}: mean 3, var = (1+1)/1 = 2, σ = √2 (padding values 100 never enter)
    A = domain_normalized_advantages(r, mask, dom)
    s0, s3 = math.sqrt(14.0), math.sqrt(2.0)
    expected = torch.tensor(
        [
            [[1 / s0, 3 / s0], [5 / s0, 7 / s0]],
            [[2 / s3, 4 / s3], [0.0, 0.0]],
            [[9 / s0, 11 / s0], [0.0, 0.0]],
        ]
    )
    torch.testing.assert_close(A, expected, rtol=1e-6, atol=0)
    stats = domain_stds(r, mask, dom)
    assert set(stats) == {0, 3}
    assert stats[0]["count"] == 6 and stats[0]["std"] == pytest.approx(s0, rel=1e-12)
    assert stats[3]["count"] == 2 and stats[3]["scale"] == pytest.approx(s3, rel=1e-12)


def test_no_mean_subtracted():
    # all rewards positive: A keeps their sign (whitening would make some negative)
    r, mask, dom = _mixed_batch()
    A = domain_normalized_advantages(r, mask, dom)
    assert torch.all(A[mask.bool()] > 0)


def test_single_domain_equals_batch_std():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(4, 6, 3, generator=g)
    mask = torch.ones(4, 6)
    mask[2, 4:] = 0
    A = domain_normalized_advantages(r, mask)  # domain_ids=None: one domain
    sigma = r[mask.bool()].double().std()  # torch.std is ddof=1
    torch.testing.assert_close(A[mask.bool()], (r[mask.bool()] / sigma).float(), rtol=1e-6, atol=0)


def test_fallback_count_below_two():
    # domain 1 holds one valid position with K=1 -> count 1 -> σ := 1, A = r
    r = torch.tensor([[[0.5], [1.5]], [[7.0], [8.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    A = domain_normalized_advantages(r, mask, torch.tensor([0, 1]))
    # domain 0: {0.5, 1.5}: var = (0.25+0.25)/1 = 0.5
    torch.testing.assert_close(A[0], r[0] / math.sqrt(0.5))
    assert A[1, 0, 0].item() == 7.0 and A[1, 1, 0].item() == 0.0
    assert math.isnan(domain_stds(r, mask, torch.tensor([0, 1]))[1]["std"])


def test_fallback_tiny_std():
    # constant rewards: σ = 0 < 1e-8 -> σ := 1; and a σ of 1e-9 (values 1 ± 1e-9) too
    r = torch.full((2, 3, 2), 0.25)
    mask = torch.ones(2, 3)
    assert torch.equal(domain_normalized_advantages(r, mask), r)
    r64 = torch.tensor([[[1.0, 1.0 + 1e-9]]], dtype=torch.float64)
    A = domain_normalized_advantages(r64, torch.ones(1, 1))
    torch.testing.assert_close(A, r64)  # float64 in, float64 out (no downcast)


def test_std_floor_bounds_the_divisor_per_domain():
    # σ_0 = √14 ≈ 3.74 and σ_3 = √2 ≈ 1.41 (test above): a floor of 2 lifts only domain 3's divisor, a floor of 0
    # is the paper's σ_d exactly, and a floor of 100 divides every domain by 100
    r, mask, dom = _mixed_batch()
    paper = domain_normalized_advantages(r, mask, dom)
    assert torch.equal(domain_normalized_advantages(r, mask, dom, std_floor=0.0), paper)
    A = domain_normalized_advantages(r, mask, dom, std_floor=2.0)
    is0 = dom == 0
    assert torch.equal(A[is0], paper[is0])
    torch.testing.assert_close(A[~is0], r[~is0] * mask[~is0].unsqueeze(-1) / 2.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(domain_normalized_advantages(r, mask, dom, std_floor=100.0),
                               r * mask.unsqueeze(-1) / 100.0, rtol=1e-6, atol=0)
    stats = domain_stds(r, mask, dom, std_floor=2.0)
    assert stats[3]["scale"] == 2.0 and stats[3]["std"] == pytest.approx(math.sqrt(2.0), rel=1e-12)
    assert stats[0]["scale"] == pytest.approx(math.sqrt(14.0), rel=1e-12)


def test_std_floor_keeps_the_fallbacks():
    # count < 2 and σ_d < 1e-8 still give σ := 1 (A = r), below or above the floor
    r = torch.full((2, 3, 2), 0.25)
    mask = torch.ones(2, 3)
    for floor in (0.5, 3.0):
        assert torch.equal(domain_normalized_advantages(r, mask, std_floor=floor), r)
    one = torch.tensor([[[7.0]]])
    assert torch.equal(domain_normalized_advantages(one, torch.ones(1, 1), std_floor=3.0), one)


@pytest.mark.parametrize("floor", [-0.1, float("inf"), float("nan"), True, "0.1", None])
def test_std_floor_rejects_a_bad_value(floor):
    r, mask, dom = _mixed_batch()
    with pytest.raises(ValueError, match="std_floor must be a finite float >= 0"):
        domain_normalized_advantages(r, mask, dom, std_floor=floor)


def test_all_padding_domain_is_zero_and_not_nan():
    r = torch.randn(2, 3, 2)
    mask = torch.zeros(2, 3)
    A = domain_normalized_advantages(r, mask)
    assert torch.all(A == 0)


def test_bad_domain_ids():
    r, mask, _ = _mixed_batch()
    with pytest.raises(ValueError, match="domain_ids"):
        domain_normalized_advantages(r, mask, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="domain_ids"):
        domain_normalized_advantages(r, mask, torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="sync=True"):
        domain_normalized_advantages(r, mask, sync=True)


def test_moments_add_across_simulated_ranks():
    # two simulated DP ranks holding different responses (and different domain sets): summed moments give
    # the same σ_d as the unsharded batch
    r, mask, dom = _mixed_batch()
    full = stds_from_moments(domain_moments(r, mask, dom, num_domains=4))
    m_a = domain_moments(r[:1], mask[:1], dom[:1], num_domains=4)
    m_b = domain_moments(r[1:], mask[1:], dom[1:], num_domains=4)
    sharded = stds_from_moments(m_a + m_b)
    torch.testing.assert_close(sharded[[0, 3]], full[[0, 3]], rtol=1e-12, atol=0)
    assert torch.isnan(full[1]) and torch.isnan(full[2])  # absent domains


def test_all_reduce_across_two_simulated_ranks(simulated_ranks):
    r, mask, dom = _mixed_batch()
    expected = domain_normalized_advantages(r, mask, dom)
    fake = simulated_ranks(2)
    # rank 0 holds response 0 (domain 0 only: its table has 1 row); rank 1 holds responses 1-2 (domains 3, 0)
    shards = [slice(0, 1), slice(1, 3)]
    outs = fake.run(lambda k: domain_normalized_advantages(r[shards[k]], mask[shards[k]], dom[shards[k]]))
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-6, atol=0)
    # without the reduction, rank 0 alone would use σ over its own 4 values {1,3,5,7}: var = 20/3
    local = domain_normalized_advantages(r[:1], mask[:1], dom[:1], sync=False)
    torch.testing.assert_close(local[0, 0, 0], torch.tensor(1 / math.sqrt(20 / 3)))


def test_advantages_and_stds_of_one_step_come_from_one_sigma(monkeypatch):
    # what a MOPD step needs: A and the logged σ_d, equal to the two functions' results, from ONE all-reduce of the
    # moments (plus the table-size one) and one check of std_floor, where the two functions take two of each
    import torch.distributed as dist

    from claas_verl.distill import topk as topk_module

    r, mask, dom = _mixed_batch()
    A_ref = domain_normalized_advantages(r, mask, dom, std_floor=2.5)
    stats_ref = domain_stds(r, mask, dom, std_floor=2.5)
    calls = {"all_reduce": 0, "check_std_floor": 0}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.__setitem__("all_reduce", calls["all_reduce"] + 1))
    check = topk_module.check_std_floor
    monkeypatch.setattr(topk_module, "check_std_floor",
                        lambda v: calls.__setitem__("check_std_floor", calls["check_std_floor"] + 1) or check(v))
    A, stats = domain_advantages_and_stds(r, mask, dom, std_floor=2.5)  # one rank: the reductions are no-ops
    assert torch.equal(A, A_ref) and stats == stats_ref and sorted(stats) == [0, 3]
    assert calls == {"all_reduce": 2, "check_std_floor": 1}
    assert domain_advantages_and_stds(r, mask, dom, stats=False)[1] is None
