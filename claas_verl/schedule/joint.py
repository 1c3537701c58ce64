"""Joint MOPD, the non-continual reference (docs/math.md §B.8 "Joint MOPD", MOPD paper §5.1).

One stage from pi_0 over every block of every domain, each block routed to its domain's expert.
Order [CHOICE]: rounds r = 0, 1, ...; within a round the domains in ``order``; a domain whose blocks
are exhausted is skipped. ``passes`` repeats the whole list (joint2 = 2 passes, 208 steps). The order
is a flag because the MOPD paper's three-domain data (the first 62 steps of a joint run giving 20/21/21
logic/math/code blocks) suggests the reference ran logic last in each round.
"""

from __future__ import annotations

from collections.abc import Sequence

from claas_verl.schedule.plan import Step, expert


def joint_steps(order: Sequence[str], num_blocks: dict[str, int], passes: int = 1, stage: int = 1) -> list[Step]:
    if passes < 1:
        raise ValueError(f"mopd.joint.passes must be >= 1, got {passes}")
    one_pass = []
    for r in range(max(num_blocks[d] for d in order)):
        for d in order:
            if r < num_blocks[d]:
                one_pass.append(Step(stage=stage, kind="joint", domain=d, block=r, teacher=expert(d)))
    return one_pass * passes
