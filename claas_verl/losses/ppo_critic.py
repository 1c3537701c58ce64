"""What PPO-with-critic needs on top of verl's GAE and value loss in the replay setting (SPEC A.3.2).

verl's ``compute_gae_advantage_return`` and ``compute_value_loss`` are reused as they are (the
calls live in ``claas_verl.verl_ext.claas_losses``). This torch-only module adds the inputs the
replay setting must build itself:

- token rewards from a replayed entry's scalar reward (r at the last valid token, 0 elsewhere);
- scenario mode: the scenario reward at the last token of the last step (default) or, as a flag,
  each step's own reward at that step's last token;
- closed-form value targets for replayed entries (γ, λ = 1 gives returns = r on every valid token),
  used as the reference the verl GAE call is checked against and by trainers that skip GAE.

The critic is re-evaluated on the sampled minibatch before the update (V_old), so replayed value
targets are built from today's critic; their staleness is ignored as in the paper [CHOICE].
"""

from __future__ import annotations

import torch

REWARD_PLACEMENTS = ("scenario", "per_step")


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last m=1 position of each row, ``[B]`` long; −1 for rows with no valid token."""
    m = response_mask.bool()
    t = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, t, torch.full_like(t, -1)).max(dim=-1).values


def token_rewards_at_last_token(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """R[e,j] = r_e at the last valid token of row e, 0 elsewhere (verl convention, SPEC A.3.2); ``[B, T]`` fp32.

    A row with n = 0 gets an all-zero row (it contributes nothing, SPEC A.2.4).
    """
    if rewards.dim() != 1 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(f"rewards must be [B] matching response_mask [B, T]; got {tuple(rewards.shape)}, "
                         f"{tuple(response_mask.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards hold NaN/inf; None rewards are dropped before insertion (SPEC A.1.4)")
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = last_valid_index(response_mask)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def scenario_token_rewards(
    step_ids: torch.Tensor,
    *,
    scenario_rewards: torch.Tensor | None = None,
    step_rewards: torch.Tensor | None = None,
    placement: str = "scenario",
) -> torch.Tensor:
    """Token rewards for a scenario entry whose steps are concatenated in one row (SPEC A.3.2, A.1.5).

    Args:
        step_ids: ``[B, T]`` long, the step index s ≥ 0 of each generated token and −1 on prompt,
            user/observation and padding tokens (so ``response_mask = step_ids >= 0``).
        scenario_rewards: ``[B]`` r_i (A.1.5, min over steps by default); required for ``"scenario"``.
        step_rewards: ``[B, S]`` per-step grades r_{i,t}; required for ``"per_step"``.
        placement: ``"scenario"`` (default, SPEC): r_i at the last token of the last step, so every
            method optimises the same scalar. ``"per_step"`` (flag): r_{i,s} at the last token of step s.

    Returns:
        ``[B, T]`` fp32 token rewards.
    """
    if placement not in REWARD_PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not supported; choose one of {REWARD_PLACEMENTS}")
    mask = step_ids >= 0
    if placement == "scenario":
        if scenario_rewards is None:
            raise ValueError("placement='scenario' needs scenario_rewards [B] (SPEC A.1.5 reduction of step grades)")
        return token_rewards_at_last_token(scenario_rewards, mask)
    if step_rewards is None:
        raise ValueError("placement='per_step' needs step_rewards [B, S]")
    if step_rewards.dim() != 2 or step_rewards.shape[0] != step_ids.shape[0]:
        raise ValueError(f"step_rewards must be [B, S]; got {tuple(step_rewards.shape)}")
    out = torch.zeros(step_ids.shape, dtype=torch.float32, device=step_ids.device)
    n_steps = int(step_ids.max().item()) + 1 if bool(mask.any()) else 0
    if n_steps > step_rewards.shape[1]:
        raise ValueError(f"step_ids reference step {n_steps - 1} but step_rewards has only {step_rewards.shape[1]}")
    for s in range(n_steps):
        in_step = step_ids == s
        last = last_valid_index(in_step)
        rows = torch.nonzero(last >= 0).flatten()
        r = step_rewards[rows, s].float()
        if not bool(torch.isfinite(r).all()):
            raise ValueError(f"step_rewards hold NaN/inf for step {s}; a scenario with a None step is dropped")
        out[rows, last[rows]] = r
    return out


def mc_value_targets(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0):
    """Monte-Carlo value targets (GAE with λ = 1): ret_j = Σ_{k ≥ j, m_k=1} γ^{#valid steps j→k}·R_k, ``[B, T]``.

    With the SPEC defaults γ = λ = 1 this is r_e on every valid token of a replayed entry and 0 on padding,
    which is what verl's GAE returns (A + V) reduce to. Positions with m = 0 are skipped (not discounted).
    """
    from claas_verl.losses.advantages import discounted_returns

    return discounted_returns(token_level_rewards, response_mask, gamma)
