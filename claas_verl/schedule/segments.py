"""Segment-wise consolidation, scenario S3 (MOPD paper §6 "Segment-wise consolidation", §3.1 "Scenarios").

MOPD paper §6 proposes, without running it: split a long sequence into segments (e.g. 15 stages into three of
five), "use fixed-share replay inside each segment and end each segment with a recovery stage. In that
stage the model produced by the previous recovery teaches the domains of earlier segments. The replay
budget and the number of teachers of a recovery stage are then both bounded by the segment size. At
any time only the last consolidated model and the snapshots of the current segment are kept."

Our reading (each point is a choice the paper leaves open):
1. Segments are consecutive chunks of ``mopd.order`` of ``mopd.segments.size`` domains; the last may be
   shorter.
2. Inside a segment the configured budget (``mopd.budget``; the S3 recipe uses ``fixed``) applies with
   the stages numbered locally, and replay covers only the earlier domains OF THE SEGMENT: that is what
   keeps the replay budget bounded by the segment size. Local stage 1 of a segment has no replay.
   ``fixed_from_stage`` is also local (f=3 makes local stage 2 the shared-budget stage, as in the MOPD paper).
   Domains of earlier segments are rehearsed only in the segment-end recovery stages.
3. Every segment ends with a recovery stage (stages are numbered in execution order, so segment g's
   recovery stage directly follows its last domain stage). It covers every domain learned so far with
   ``blocks_per_domain`` blocks each, ``spread(c_rec, N_d)``, taken in turn in sequence order, like the
   final recovery of B.8. Teachers: a domain of the current segment goes to its stage snapshot
   (``student:<its stage>``; the segment's last domain to the model the recovery starts from) or to
   its expert with ``mopd.recovery.teachers=experts``; a domain of an earlier segment goes to the
   previous consolidated model, ``student:<previous recovery stage>``. A recovery therefore has at most
   size + 1 teachers.
4. The next segment starts from the consolidated model (stage s always starts from student:<s-1>).

With one segment (size >= K) the plan equals the S2 plan "budget + final recovery".
"""

from __future__ import annotations

from collections.abc import Sequence

from claas_verl.schedule.plan import Step, expert, student
from claas_verl.schedule.recovery import recovery_steps
from claas_verl.schedule.sequence import sequence_steps


def segment_bounds(num_domains: int, size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` index ranges of ``order`` for each segment (end exclusive)."""
    if size < 1:
        raise ValueError(f"mopd.segments.size must be >= 1, got {size}")
    return [(s, min(s + size, num_domains)) for s in range(0, num_domains, size)]


def segmented_steps(
    order: Sequence[str], num_blocks: dict[str, int], size: int, budget: str, m: int, b: int, f: int,
    blocks_per_domain: int, recovery_teachers: str = "snapshots", cycle: str = "forward",
) -> list[Step]:
    steps: list[Step] = []
    stage = 0
    consolidated: int | None = None  # stage of the last recovery (its output teaches earlier segments)
    for start, end in segment_bounds(len(order), size):
        seg = list(order[start:end])
        steps.extend(sequence_steps(seg, num_blocks, budget, m=m, b=b, f=f, stage_offset=stage, cycle=cycle))
        own_stage = {d: stage + k for k, d in enumerate(seg, start=1)}
        stage += len(seg)
        teacher_of = {}
        for d in order[:end]:
            if d in own_stage:
                teacher_of[d] = expert(d) if recovery_teachers == "experts" else student(own_stage[d])
            else:
                teacher_of[d] = student(consolidated)
        stage += 1
        steps.extend(recovery_steps(stage, list(order[:end]), num_blocks, blocks_per_domain, teacher_of))
        consolidated = stage
    return steps
