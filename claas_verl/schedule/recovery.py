"""Final multi-teacher recovery stage (docs/math.md §B.8 "Recovery", MOPD paper §3.1 and App. "Seq + Recovery").

The stage starts from the last student (fresh AdamW, token loss only: the trainer's business) and
gives every domain ``c_rec`` blocks ``spread(c_rec, N_d)``; step i teaches ``domains[i mod K]`` with
that domain's block ``list_d[i div K]``, so the domains are taken in turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from claas_verl.schedule.plan import Step
from claas_verl.schedule.spread import spread


def recovery_steps(
    stage: int, domains: Sequence[str], num_blocks: dict[str, int], blocks_per_domain: int,
    teacher_of: dict[str, str],
) -> list[Step]:
    """Recovery stage ``stage``: K·c_rec steps over ``domains`` in turn, each routed to ``teacher_of[d]``.

    ``teacher_of`` is ``student:<stage of d>`` for snapshot recovery (so the last domain is taught by
    the model the stage starts from, and logic by the shared stage-1 model) or ``expert:<d>`` for
    expert recovery (MOPD paper §5.4).
    """
    for d in domains:
        if not 1 <= blocks_per_domain <= num_blocks[d]:
            raise ValueError(
                f"mopd.recovery.blocks_per_domain={blocks_per_domain} must lie in 1..{num_blocks[d]} "
                f"(the blocks of domain {d!r})"
            )
    lists = {d: spread(blocks_per_domain, num_blocks[d]) for d in domains}
    K = len(domains)
    steps = []
    for i in range(K * blocks_per_domain):
        d = domains[i % K]
        steps.append(Step(stage=stage, kind="recovery", domain=d, block=lists[d][i // K], teacher=teacher_of[d]))
    return steps
