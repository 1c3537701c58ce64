"""REINFORCE++ advantages for replayed CLaaS entries (docs/math.md §A.3.1), torch only.

Two modes (config ``rpp_adv``):

- ``"ema"`` (default): an exponentially weighted mean b and variance v of every reward at
  buffer-insertion time; a sampled entry gets A = m·(r − b)/sqrt(max(v, v_min)). Batch
  whitening would cancel any baseline and divide by zero when all M rewards are equal
  (common with M=8 binary rewards), hence the running statistics.
- ``"global_whiten"``: verl / Hu et al. REINFORCE++: discounted returns, whitened over the
  minibatch's valid tokens, no baseline.

The EMA state is a plain object with ``state_dict``/``load_state_dict`` so the trainer can
save it in checkpoints next to the replay buffer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from claas_verl.utils.masked import masked_mean, masked_sum

RPP_ADV_MODES = ("ema", "global_whiten")


class EmaRewardStats:
    """Running EW mean/variance of rewards (docs/math.md §A.3.1, Finch 2009 incremental form).

    On every non-None reward, with α = 1 − β::

        δ = r − b;   b ← b + α·δ;   v ← (1 − α)·(v + α·δ²)

    Args:
        beta: decay β ∈ [0, 1] (default 0.9, i.e. α = 0.1).
        b0, v0: prior mean/variance (defaults 0.5 and 0.25, the Bernoulli(½) prior for {0,1} rewards).
        v_min: variance floor used when normalising (default 0.01, a std of at least 0.1).
    """

    def __init__(self, beta: float = 0.9, b0: float = 0.5, v0: float = 0.25, v_min: float = 0.01):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta} must be in [0, 1] (alpha = 1 - beta is the EMA step)")
        if not (math.isfinite(b0) and math.isfinite(v0) and v0 >= 0.0):
            raise ValueError(f"b0={b0} must be finite and v0={v0} finite and >= 0")
        if not (math.isfinite(v_min) and v_min > 0.0):
            raise ValueError(f"v_min={v_min} must be a finite positive variance floor")
        self.beta = float(beta)
        self.v_min = float(v_min)
        self.baseline = float(b0)
        self.variance = float(v0)
        self.count = 0

    @property
    def alpha(self) -> float:
        return 1.0 - self.beta

    @property
    def std(self) -> float:
        """sqrt(max(v, v_min)), the denominator of the advantage."""
        return math.sqrt(max(self.variance, self.v_min))

    def update(self, reward: float) -> None:
        """Fold one reward in; call this at INSERTION time, for non-None rewards only (A.1.4)."""
        if reward is None:
            raise ValueError("reward is None: entries with a grader error are dropped before insertion "
                             "(docs/math.md §A.1.4)")
        r = float(reward)
        if not math.isfinite(r):
            raise ValueError(f"reward={reward} is not finite; refuse to poison the EMA baseline")
        a = self.alpha
        delta = r - self.baseline
        self.baseline += a * delta
        self.variance = (1.0 - a) * (self.variance + a * delta * delta)
        self.count += 1

    def update_many(self, rewards: Iterable[float]) -> None:
        for r in rewards:
            self.update(r)

    def advantages(self, rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """A[e,j] = m[e,j]·(r_e − b)/sqrt(max(v, v_min)) with the CURRENT b, v; see :func:`ema_advantages`."""
        return ema_advantages(rewards, response_mask, self.baseline, self.variance, self.v_min)

    def state_dict(self) -> dict:
        return {
            "beta": self.beta, "v_min": self.v_min,
            "baseline": self.baseline, "variance": self.variance, "count": self.count,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"beta", "v_min", "baseline", "variance", "count"} - set(state)
        if missing:
            raise ValueError(f"EmaRewardStats state is missing keys {sorted(missing)}")
        self.__init__(beta=state["beta"], b0=state["baseline"], v0=state["variance"], v_min=state["v_min"])
        self.count = int(state["count"])

    def __repr__(self) -> str:
        return (f"EmaRewardStats(beta={self.beta}, baseline={self.baseline:.6g}, variance={self.variance:.6g}, "
                f"v_min={self.v_min}, count={self.count})")


def ema_advantages(
    rewards: torch.Tensor, response_mask: torch.Tensor, baseline: float, variance: float, v_min: float = 0.01
) -> torch.Tensor:
    """REINFORCE++-EMA advantage (docs/math.md §A.3.1): ``[B, T]`` = m·(r − b)/sqrt(max(v, v_min)), fp32.

    Args:
        rewards: ``[B]`` scalar rewards r_e (finite).
        response_mask: ``[B, T]``; padding gets A = 0.
        baseline, variance: b and v read when the minibatch is built.
    """
    if rewards.dim() != 1 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(f"rewards must be [B] matching response_mask [B, T]; got {tuple(rewards.shape)} "
                         f"and {tuple(response_mask.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards hold NaN/inf; None rewards must be dropped before insertion (docs/math.md §A.1.4)")
    if not (math.isfinite(baseline) and math.isfinite(variance) and v_min > 0):
        raise ValueError(f"baseline={baseline}, variance={variance} must be finite and v_min={v_min} > 0")
    scale = math.sqrt(max(variance, v_min))
    a = (rewards.float() - baseline) / scale
    return a.unsqueeze(-1) * response_mask.float()


def sequence_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """r_e = Σ_j m·R[e,j], shape ``[B]``: recovers the scalar reward verl places on the last valid token."""
    return masked_sum(token_level_rewards.float(), response_mask, dim=-1)


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0):
    """G_t = R_t + γ·G_{t+1} over valid tokens, carried unchanged across m=0 positions (verl REINFORCE++)."""
    m = response_mask.float()
    r = torch.where(response_mask.bool(), token_level_rewards.float(), torch.zeros_like(m))
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        new = r[:, t] + gamma * running
        returns[:, t] = new * m[:, t]
        running = new * m[:, t] + running * (1.0 - m[:, t])
    return returns


def global_whiten_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ ``global_whiten`` mode (docs/math.md §A.3.1, verl): ``(A, returns)``, both ``[B, T]``.

    A = (G − μ)/sqrt(var + 1e-8)·m with μ, var (unbiased) over the minibatch's valid tokens.
    Edge cases ([CHOICE] where verl raises): Σm ≤ 1 → A = 0; all valid returns equal → A = 0 exactly
    (the +1e-8 in the masked mean would otherwise leave a ~1e-4 residue).
    """
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must both be [B, T]")
    mask = response_mask.bool()
    if bool((~torch.isfinite(token_level_rewards) & mask).any()):
        raise ValueError("token_level_rewards hold NaN/inf on valid positions")
    returns = discounted_returns(token_level_rewards, mask, gamma)
    n = float(mask.sum())
    if n <= 1:
        return torch.zeros_like(returns), returns
    valid = returns[mask]
    if bool((valid == valid[0]).all()):
        return torch.zeros_like(returns), returns
    mu = masked_mean(returns, mask)
    var = masked_mean((returns - mu) ** 2, mask) * (n / (n - 1.0))
    adv = (returns - mu) * torch.rsqrt(var + 1e-8) * mask.float()
    return adv, returns
