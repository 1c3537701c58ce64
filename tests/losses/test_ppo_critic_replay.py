"""SPEC A.3.2: token rewards for replayed entries, scenario placements, verl GAE / value loss glue."""

import pytest
import torch

from claas_verl.losses import mc_value_targets, scenario_token_rewards, token_rewards_at_last_token
from claas_verl.verl_ext.claas_losses import replay_gae, replay_value_loss


def test_reward_at_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    R = token_rewards_at_last_token(torch.tensor([1.0, 0.5, 9.0]), mask)
    assert R.tolist() == [[0, 0, 1.0, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]]  # n=0 row stays empty
    with pytest.raises(ValueError, match="NaN"):
        token_rewards_at_last_token(torch.tensor([float("nan")]), mask[:1])


def test_scenario_placements():
    # two steps: step 0 on tokens 0-1, a user turn (−1) on 2, step 1 on tokens 3-4, padding on 5
    step_ids = torch.tensor([[0, 0, -1, 1, 1, -1]])
    R = scenario_token_rewards(step_ids, scenario_rewards=torch.tensor([0.0]) + 0.25)
    assert R.tolist() == [[0, 0, 0, 0, 0.25, 0]]  # r_i at the last token of the last step
    R = scenario_token_rewards(step_ids, step_rewards=torch.tensor([[1.0, 0.0]]) + 0.5, placement="per_step")
    assert R.tolist() == [[0, 1.5, 0, 0, 0.5, 0]]
    with pytest.raises(ValueError, match="scenario_rewards"):
        scenario_token_rewards(step_ids)
    with pytest.raises(ValueError, match="only 1"):
        scenario_token_rewards(step_ids, step_rewards=torch.tensor([[1.0]]), placement="per_step")


def test_replay_gae_gamma_lambda_one_gives_returns_equal_reward():
    # γ = λ = 1: Â_j = r − V_j and returns = r on every valid token; observation tokens are skipped.
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]]).float()
    values = torch.tensor([[0.2, 0.4, 5.0, 0.6, 5.0], [0.1, 0.1, 0.1, 0.0, 0.0]])
    adv, ret = replay_gae(torch.tensor([1.0, 0.0]), values, mask)
    target = mc_value_targets(token_rewards_at_last_token(torch.tensor([1.0, 0.0]), mask), mask)
    assert torch.allclose(ret * mask, target)
    assert torch.allclose(target, torch.tensor([[1.0, 1, 0, 1, 0], [0, 0, 0, 0, 0]]))
    raw = (target - values) * mask  # [0.8, 0.6, ·, 0.4] and [-0.1, -0.1, -0.1]
    mu = raw.sum() / mask.sum()
    var = (((raw - mu) * mask) ** 2).sum() / (mask.sum() - 1)
    assert torch.allclose(adv, (raw - mu) / torch.sqrt(var + 1e-8) * mask, atol=1e-5)


def test_replay_gae_discounted_and_single_token():
    # γ = 0.5, λ = 1: returns = [0.25, 0.5, 1]·r over the 3 valid tokens
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    _, ret = replay_gae(torch.tensor([1.0, 2.0]), torch.zeros(2, 3), mask, gamma=0.5)
    assert torch.allclose(ret * mask, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    adv, ret = replay_gae(torch.tensor([3.0]), torch.tensor([[0.5, 0.0]]), torch.tensor([[1.0, 0.0]]))
    assert adv.tolist() == [[0.0, 0.0]] and ret[0, 0].item() == 3.0  # Σm = 1: verl would raise


def test_replay_value_loss_hand_value():
    # V = 1.0, V_old = 0, ret = 0.2, clip 0.5: (V-ret)² = 0.64, (clip(1.0, -0.5, 0.5) - ret)² = 0.09
    # → max = 0.64 on both tokens; ½·token-mean = 0.32; the clipped branch is never larger → clipfrac 0
    loss, clipfrac = replay_value_loss(torch.ones(1, 2), torch.full((1, 2), 0.2), torch.zeros(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.32, abs=1e-6)
    assert clipfrac == 0.0
