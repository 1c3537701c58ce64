"""Build an environment by name from config kwargs (what a Hydra ``env:`` block maps to)."""

from __future__ import annotations

from typing import Any

from claas_verl.claas.envs.environment import Environment
from claas_verl.claas.envs.ih_challenge import IHChallengeEnv
from claas_verl.claas.envs.rule_following import RuleFollowingEnv
from claas_verl.sandbox import SandboxLimits

ENVIRONMENTS = {"rule_following": RuleFollowingEnv, "ih_challenge": IHChallengeEnv}


def make_environment(name: str, **kwargs: Any) -> Environment:
    """``make_environment("rule_following", num_scenarios=100, seed=0)`` or
    ``make_environment("ih_challenge", path=..., sandbox={"timeout_s": 5, "cpu_s": 5, "memory_mb": 512})``.

    Unknown names and unknown keyword arguments raise ValueError (never silently ignored).
    """
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose one of {sorted(ENVIRONMENTS)}")
    if name == "ih_challenge" and "sandbox" in kwargs:
        sandbox = kwargs.pop("sandbox")
        kwargs["limits"] = SandboxLimits(**dict(sandbox))
    try:
        return ENVIRONMENTS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"environment {name!r}: bad arguments {sorted(kwargs)}: {e}") from e
