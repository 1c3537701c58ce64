"""A finite pool of scenarios and its deterministic stream of K splits (docs/math.md §A.1.6).

Above :mod:`claas_verl.claas.envs.base` (the scenario interface) and :mod:`claas_verl.claas.envs.stream` (the splits),
so that both import in one direction only.
"""

from __future__ import annotations

from collections.abc import Sequence

from claas_verl.claas.envs.base import Scenario
from claas_verl.claas.envs.stream import ScenarioStream


class Environment:
    """A finite pool of scenarios. Subclasses fill ``self._scenarios``; ``close()`` frees resources."""

    name: str = "environment"

    def __init__(self, scenarios: Sequence[Scenario]):
        ids = [s.scenario_id for s in scenarios]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"{self.name}: duplicate scenario ids {dup[:5]}; ids must be unique")
        self._scenarios = tuple(scenarios)

    def scenarios(self) -> tuple[Scenario, ...]:
        return self._scenarios

    def __len__(self) -> int:
        return len(self._scenarios)

    def stream(self, seed: int, num_splits: int, split_size: int | None = None,
               split_groups: Sequence[str] | None = None, group_key: str = "families"):
        """Deterministic shuffled stream cut into K splits (see :class:`ScenarioStream`)."""
        return ScenarioStream(self._scenarios, seed=seed, num_splits=num_splits, split_size=split_size,
                              split_groups=split_groups, group_key=group_key)

    def close(self) -> None:
        """Release external resources (grader sandboxes). Idempotent; the base holds none."""
