"""Replay budgets inside the stages of a sequence (docs/math.md §B.8: Seq, shared budget, fixed share).

All functions take the domains of ONE sequence in order and their block counts; ``k`` is the 1-based
stage within that sequence (stage k learns ``domains[k-1]`` and may replay ``domains[:k-1]``). Replay
lists are returned as ``[(domain, block), ...]`` in replay order i = 0..R_k-1; ``interleave`` places
them among the new-domain steps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from claas_verl.schedule.spread import spread

REPLAY_CYCLES = ("forward", "reversed")


def replay_cycle(earlier: Sequence[str], count: int, cycle: str = "forward") -> list[str]:
    """The domains of a stage's ``count`` replay steps, in execution order.

    ``forward`` (the MOPD paper): replay i teaches ``earlier[i mod len(earlier)]``, d_1 first. ``reversed`` (a
    deviation, #56's E5): the same list read backwards, so d_1 is replayed LAST whatever ``count`` is; every domain
    keeps its number of replay steps. With one earlier domain (stage 2) both are the same list.
    """
    if cycle not in REPLAY_CYCLES:
        raise ValueError(f"mopd.replay.cycle must be one of {list(REPLAY_CYCLES)}, got {cycle!r}")
    if count and not earlier:
        raise ValueError(f"{count} replay steps but no earlier domain to replay")
    forward = [earlier[i % len(earlier)] for i in range(count)]
    return forward[::-1] if cycle == "reversed" else forward


def shared_replay(k: int, domains: Sequence[str], num_blocks: dict[str, int], m: int,
                  cycle: str = "forward") -> list[tuple[str, int]]:
    """Shared budget: R_k = floor(n_k / m) replay steps cycling d_1..d_{k-1}; blocks spread per stage.

    Replay i teaches ``domains[i mod (k-1)]`` (``cycle="reversed"``: that list backwards, :func:`replay_cycle`);
    that domain's c_{k,d} blocks are ``spread(c_{k,d}, N_d)``, chosen independently in every stage and consumed
    ascending. ``floor`` when m does not divide n_k is a [CHOICE] (docs/math.md §E.12).
    """
    if k < 2:
        return []
    if m < 1:
        raise ValueError(f"mopd.replay.m must be >= 1, got {m}")
    earlier = list(domains[: k - 1])
    n_k = num_blocks[domains[k - 1]]
    cycle = replay_cycle(earlier, n_k // m, cycle)
    counts = Counter(cycle)
    lists = {d: spread(counts[d], num_blocks[d]) for d in earlier}
    return _consume(cycle, lists)


def fixed_pools(domains: Sequence[str], num_blocks: dict[str, int], b: int, f: int) -> dict[tuple[int, str], list[int]]:
    """Fixed share block lists ``{(stage k, domain): blocks}`` for every stage k >= f.

    Domain d_j is replayed in the stages S_j = [max(f, j+1) .. K]; its b·|S_j| blocks are
    ``spread(b·|S_j|, N_j)`` dealt round-robin, so stage S_j[s] gets ``pool[s::|S_j|]``: successive stages
    revisit different prompts of the domain (MOPD paper §4.2).
    """
    if b < 0:
        raise ValueError(f"mopd.replay.b must be >= 0, got {b}")
    if f < 2:
        raise ValueError(f"mopd.replay.fixed_from_stage must be >= 2, got {f}")
    K = len(domains)
    out: dict[tuple[int, str], list[int]] = {}
    for j, d in enumerate(domains, start=1):
        stages = list(range(max(f, j + 1), K + 1))
        if not stages:
            continue
        pool = spread(b * len(stages), num_blocks[d])
        for s, stage in enumerate(stages):
            out[(stage, d)] = pool[s :: len(stages)]
    return out


def fixed_replay(
    k: int, domains: Sequence[str], pools: dict[tuple[int, str], list[int]], b: int, cycle: str = "forward"
) -> list[tuple[str, int]]:
    """Fixed share in stage k >= f: R_k = b(k-1); replay i teaches d_{i mod (k-1)} with its next pooled block
    (``cycle="reversed"``: the same steps in the opposite order, :func:`replay_cycle`)."""
    if k < 2:
        return []
    earlier = list(domains[: k - 1])
    return _consume(replay_cycle(earlier, b * (k - 1), cycle), {d: pools[(k, d)] for d in earlier})


def stage_replay(
    k: int, domains: Sequence[str], num_blocks: dict[str, int], budget: str, m: int, b: int, f: int,
    pools: dict[tuple[int, str], list[int]] | None = None, cycle: str = "forward",
) -> list[tuple[str, int]]:
    """Replay list of stage k under ``budget`` ∈ {seq, shared, fixed}; fixed stages below f use the shared rule.
    ``cycle``: the order of the earlier domains' replay steps (:func:`replay_cycle`)."""
    if budget == "seq" or k < 2:
        return []
    if budget == "shared" or (budget == "fixed" and k < f):
        return shared_replay(k, domains, num_blocks, m, cycle)
    if budget == "fixed":
        if pools is None:
            pools = fixed_pools(domains, num_blocks, b, f)
        return fixed_replay(k, domains, pools, b, cycle)
    raise ValueError(f"mopd.budget must be one of ['seq', 'shared', 'fixed'], got {budget!r}")


def replay_slots(n: int, R: int) -> list[int]:
    """1-based new-domain step after which replay i = 1..R runs: ceil(i·n/R) (docs/math.md §B.8 "Positions").

    Forced for the shared budget (one replay after every m new steps); a [CHOICE] for the fixed share.
    """
    if R == 0:
        return []
    if n < 1:
        raise ValueError(f"a stage with replay steps needs at least one new-domain step, got n={n}")
    return [-(-i * n // R) for i in range(1, R + 1)]


def interleave(new: list, replay: list) -> list:
    """Merge a stage's new-domain items and replay items: replay i right after new item ceil(i·n/R)."""
    slots = replay_slots(len(new), len(replay))
    out: list = []
    r = 0
    for t, item in enumerate(new, start=1):
        out.append(item)
        while r < len(replay) and slots[r] == t:  # replays sharing a slot keep the order of i
            out.append(replay[r])
            r += 1
    assert r == len(replay), "every replay slot lies in 1..n"
    return out


def _consume(cycle: list[str], lists: dict[str, list[int]]) -> list[tuple[str, int]]:
    used: Counter[str] = Counter()
    out = []
    for d in cycle:
        out.append((d, lists[d][used[d]]))
        used[d] += 1
    return out
