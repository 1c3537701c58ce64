"""docs/math.md §A.3.1: REINFORCE++ EMA statistics (hand-computed sequence, v_min floor, state) and global whitening."""

import math

import pytest
import torch

from claas_verl.losses import EmaRewardStats, ema_advantages, global_whiten_advantages


def test_ema_stats_hand_sequence():
    # β = 0.9 → α = 0.1; b0 = 0.5, v0 = 0.25.
    s = EmaRewardStats()
    # r=1: δ = 0.5; b = 0.5 + 0.05 = 0.55; v = 0.9·(0.25 + 0.1·0.25) = 0.9·0.275 = 0.2475
    s.update(1.0)
    assert (s.baseline, s.variance) == pytest.approx((0.55, 0.2475), abs=1e-12)
    # r=0: δ = -0.55; b = 0.55 - 0.055 = 0.495; v = 0.9·(0.2475 + 0.1·0.3025) = 0.9·0.27775 = 0.249975
    s.update(0.0)
    assert (s.baseline, s.variance) == pytest.approx((0.495, 0.249975), abs=1e-12)
    # r=1: δ = 0.505; b = 0.495 + 0.0505 = 0.5455; v = 0.9·(0.249975 + 0.1·0.255025) = 0.9·0.2754775 = 0.24792975
    s.update(1.0)
    assert (s.baseline, s.variance) == pytest.approx((0.5455, 0.24792975), abs=1e-12)
    assert s.count == 3
    # A for r = [1, 0] with two valid tokens each: (1 - 0.5455)/sqrt(0.24792975) = 0.4545/0.4979255 = 0.912787
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    a = s.advantages(torch.tensor([1.0, 0.0]), mask)
    assert a[0, 0].item() == pytest.approx(0.4545 / math.sqrt(0.24792975), abs=1e-6)
    assert a[0, 0].item() == pytest.approx(0.912787, abs=1e-5)
    assert a[1, 2].item() == pytest.approx(-0.5455 / math.sqrt(0.24792975), abs=1e-6)
    assert a[0, 2].item() == 0.0  # padding


def test_variance_floor():
    # β = 0 (α = 1): r=1 → δ = 0.5, b = 1, v = (1-1)·(...) = 0 → the floor v_min = 0.01 (std 0.1) is used:
    # a replayed failure gets A = (0 - 1)/0.1 = -10, not -inf.
    s = EmaRewardStats(beta=0.0)
    s.update(1.0)
    assert (s.baseline, s.variance) == (1.0, 0.0)
    assert s.advantages(torch.tensor([0.0]), torch.ones(1, 2))[0].tolist() == pytest.approx([-10.0, -10.0])
    # default β after 40 straight passes: 1 - b = 0.5·0.9^40 = 0.007390, v < v_min → A(0) = -b/0.1
    s = EmaRewardStats()
    s.update_many([1.0] * 40)
    assert 1 - s.baseline == pytest.approx(0.5 * 0.9**40, abs=1e-12)
    assert s.variance < 0.01
    assert s.advantages(torch.tensor([0.0]), torch.ones(1, 1)).item() == pytest.approx(-s.baseline / 0.1, abs=1e-5)


def test_state_dict_round_trip_and_bad_inputs():
    s = EmaRewardStats(beta=0.8, v_min=0.02)
    s.update_many([1, 0, 1])
    t = EmaRewardStats()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    s.update(0.0)
    t.update(0.0)
    assert (t.baseline, t.variance, t.count) == (s.baseline, s.variance, 4)
    with pytest.raises(ValueError, match="None"):
        s.update(None)
    with pytest.raises(ValueError, match="finite"):
        s.update(float("nan"))
    with pytest.raises(ValueError, match="beta"):
        EmaRewardStats(beta=1.5)
    with pytest.raises(ValueError, match="missing"):
        t.load_state_dict({"beta": 0.9})
    with pytest.raises(ValueError, match="NaN"):
        ema_advantages(torch.tensor([float("nan")]), torch.ones(1, 2), 0.5, 0.25)


def test_global_whiten_hand_values():
    # rewards 1 and 0 at the last token of two 2-token responses; γ = 1 → returns [1,1] and [0,0].
    # μ = 0.5, unbiased var = 0.25·4/3 = 1/3 → A = ±0.5/sqrt(1/3) = ±0.866025
    R = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv, ret = global_whiten_advantages(R, mask)
    assert ret.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert adv[0, :2].tolist() == pytest.approx([0.866025, 0.866025], abs=1e-5)
    assert adv[1, :2].tolist() == pytest.approx([-0.866025, -0.866025], abs=1e-5)
    assert adv[:, 2].tolist() == [0.0, 0.0]


def test_global_whiten_edge_cases():
    mask = torch.tensor([[1, 1], [1, 1]])
    adv, _ = global_whiten_advantages(torch.tensor([[0.0, 1.0], [0.0, 1.0]]), mask)  # all rewards equal
    assert torch.equal(adv, torch.zeros(2, 2))
    adv, ret = global_whiten_advantages(torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 0]]))  # Σm = 1
    assert torch.equal(adv, torch.zeros(1, 2)) and ret[0, 0].item() == 1.0
    adv, _ = global_whiten_advantages(torch.zeros(1, 2), torch.zeros(1, 2))  # Σm = 0
    assert torch.equal(adv, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="NaN"):
        global_whiten_advantages(torch.tensor([[float("nan"), 1.0]]), mask[:1])
