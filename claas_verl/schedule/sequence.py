"""Stages of a continual sequence: new-domain steps with E_k, interleaved replay with M_{k-1} (docs/math.md §B.8)."""

from __future__ import annotations

from collections.abc import Sequence

from claas_verl.schedule.budgets import fixed_pools, interleave, stage_replay
from claas_verl.schedule.plan import Step, expert, student


def sequence_steps(
    domains: Sequence[str], num_blocks: dict[str, int], budget: str, m: int = 3, b: int = 7, f: int = 3,
    stage_offset: int = 0, cycle: str = "forward",
) -> list[Step]:
    """Steps of the stages that learn ``domains`` in order, numbered ``stage_offset+1 ..``.

    Stage k (local, 1-based) runs its n_k = N_{d_k} new-domain steps on blocks 0..n_k-1 with teacher
    E_{d_k}, and its replay steps (budget rules in ``budgets``) with the frozen previous-stage student
    ``student:<global stage - 1>``; ``cycle`` orders the replay steps (``budgets.replay_cycle``).
    """
    pools = fixed_pools(domains, num_blocks, b, f) if budget == "fixed" else None
    steps: list[Step] = []
    for k, d in enumerate(domains, start=1):
        stage = stage_offset + k
        new = [Step(stage, "new", d, blk, expert(d)) for blk in range(num_blocks[d])]
        replay = [
            Step(stage, "replay", rd, blk, student(stage - 1))
            for rd, blk in stage_replay(k, domains, num_blocks, budget, m, b, f, pools, cycle)
        ]
        steps.extend(interleave(new, replay))
    return steps
