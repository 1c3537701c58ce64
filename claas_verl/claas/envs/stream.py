"""Scenario stream and its K contiguous splits (docs/math.md §A.1.6 split protocol, CLaaS paper §4).

CLaaS paper §4: N = 100 scenarios sampled with a fixed seed, "partitioned into K = 5
contiguous splits of 20 scenarios each". Here the pool is shuffled once with
``random.Random(seed)`` (a per-instance generator, so the order depends only on
the seed and the ids, never on global RNG state), optionally truncated to
``K · split_size`` scenarios, and cut into K contiguous splits. Different seeds
are the "data shuffles" of the 9 trials (3 shuffles × 3 runs).

Grouped splits (``split_groups``, an extension beyond the CLaaS paper, whose splits are i.i.d. shuffles of one mixed
pool):
split j draws only scenarios of group ``split_groups[j]`` (the value of ``scenario.meta[group_key]``, lists
joined with ``+``), in the shuffled order, without replacement. A stream that changes the rule family from split
to split is the domain-incremental setting where a policy can forget what earlier splits taught
(``benchmarks/continual_claas.py``); the seed still decides which scenarios of each group land in which split.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence

from claas_verl.claas.envs.base import Scenario


class ScenarioStream:
    """Shuffled scenario stream with K splits.

    Args:
        scenarios: the pool (order matters only through the seed's permutation).
        seed: shuffle seed; the same pool and seed always give the same stream.
        num_splits: K ≥ 1.
        split_size: scenarios per split. None uses the whole pool, which must then
            divide evenly by K (pass ``split_size`` to take the first K·split_size
            of the shuffled pool instead of dropping a remainder silently).
        split_groups: None (CLaaS paper: contiguous cuts of the shuffled pool), or one group name per split: split j
            takes the first ``split_size`` not yet used scenarios of group ``split_groups[j]`` in the shuffled
            order (``split_size`` is then required).
        group_key: the ``scenario.meta`` key that names a scenario's group (a list value is joined with ``+``).
    """

    def __init__(self, scenarios: Sequence[Scenario], seed: int, num_splits: int, split_size: int | None = None,
                 split_groups: Sequence[str] | None = None, group_key: str = "families"):
        if not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
        n = len(scenarios)
        if split_size is None:
            if n % num_splits:
                raise ValueError(
                    f"{n} scenarios do not divide into num_splits={num_splits} equal splits; pass "
                    f"split_size (e.g. {n // num_splits}) to use the first num_splits*split_size after shuffling"
                )
            split_size = n // num_splits
        if not isinstance(split_size, int) or split_size < 1:
            raise ValueError(f"split_size must be an int >= 1, got {split_size!r}")
        order = list(range(n))
        random.Random(seed).shuffle(order)
        self.seed = seed
        self.num_splits = num_splits
        self.split_size = split_size
        self.split_groups = None if split_groups is None else tuple(str(g) for g in split_groups)
        if self.split_groups is not None:
            self._splits = _grouped_splits([scenarios[i] for i in order], self.split_groups, num_splits,
                                           split_size, group_key)
            return
        if num_splits * split_size > n:
            raise ValueError(
                f"num_splits*split_size = {num_splits}*{split_size} = {num_splits * split_size} exceeds the "
                f"{n} scenarios available; lower split_size or num_splits"
            )
        chosen = [scenarios[i] for i in order[: num_splits * split_size]]
        self._splits = tuple(tuple(chosen[j * split_size:(j + 1) * split_size]) for j in range(num_splits))

    def split(self, j: int) -> tuple[Scenario, ...]:
        """Scenarios of split ``j`` (0-based; docs/math.md §A.1 writes j = 1..K)."""
        if not 0 <= j < self.num_splits:
            raise ValueError(f"split index must be in [0, {self.num_splits}), got {j}")
        return self._splits[j]

    def splits(self) -> tuple[tuple[Scenario, ...], ...]:
        return self._splits

    def __iter__(self) -> Iterator[Scenario]:
        for s in self._splits:
            yield from s

    def __len__(self) -> int:
        return self.num_splits * self.split_size

    def ids(self) -> list[list[str]]:
        """Scenario ids per split (what a run records to make its splits reproducible)."""
        return [[s.scenario_id for s in split] for split in self._splits]

    def max_entries_per_split(self, entry_unit: str = "step") -> list[int]:
        """Upper bound on buffer entries each split can add (docs/math.md §A.1.5/A.1.8).

        ``"step"``: Σ turns over the split's scenarios; ``"scenario"``: its scenario
        count. The trainer warns when ``B_min`` exceeds this (docs/math.md §A.1.8 flag).
        """
        if entry_unit == "step":
            return [sum(s.num_turns for s in split) for split in self._splits]
        if entry_unit == "scenario":
            return [len(split) for split in self._splits]
        raise ValueError(f"entry_unit must be 'step' or 'scenario', got {entry_unit!r}")


def scenario_group(scenario: Scenario, group_key: str = "families") -> str:
    """The group name of ``scenario``: ``meta[group_key]``, a list or tuple joined with ``+``."""
    meta: Mapping = scenario.meta or {}
    if group_key not in meta:
        raise ValueError(f"claas.stream.group_key: scenario {scenario.scenario_id!r} has no meta[{group_key!r}] "
                         f"(its meta keys: {sorted(meta)}); set group_key to one of them")
    value = meta[group_key]
    return "+".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


def _grouped_splits(shuffled: Sequence[Scenario], split_groups: tuple[str, ...], num_splits: int,
                    split_size: int, group_key: str) -> tuple[tuple[Scenario, ...], ...]:
    if len(split_groups) != num_splits:
        raise ValueError(f"claas.stream.split_groups names {len(split_groups)} groups but num_splits is "
                         f"{num_splits}; give one group per split")
    by_group: dict[str, list[Scenario]] = {}
    for sc in shuffled:
        by_group.setdefault(scenario_group(sc, group_key), []).append(sc)
    need: dict[str, int] = {}
    for g in split_groups:
        need[g] = need.get(g, 0) + split_size
    for g, k in need.items():
        have = len(by_group.get(g, []))
        if have < k:
            raise ValueError(
                f"claas.stream.split_groups: {split_groups.count(g)} split(s) of group {g!r} need {k} scenarios "
                f"but the pool has {have} (groups in the pool: "
                f"{ {name: len(v) for name, v in sorted(by_group.items())} }); raise claas.env.kwargs.num_scenarios "
                "or lower claas.stream.split_size")
    taken: dict[str, int] = {}
    splits = []
    for g in split_groups:
        start = taken.get(g, 0)
        splits.append(tuple(by_group[g][start:start + split_size]))
        taken[g] = start + split_size
    return tuple(splits)
