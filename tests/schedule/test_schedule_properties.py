"""The B.8 rules on other domain counts, block counts, m and b (hypothesis)."""

from collections import Counter
from math import ceil

from hypothesis import given, settings
from hypothesis import strategies as st

from claas_verl.schedule import ScheduleConfig, build_plan, spread

FAST = settings(max_examples=60, deadline=None)


@st.composite
def sequences(draw, min_k=2, max_k=7):
    K = draw(st.integers(min_k, max_k))
    order = [f"d{i}" for i in range(K)]
    blocks = draw(st.lists(st.integers(1, 25), min_size=K, max_size=K))
    return order, dict(zip(order, blocks))


def make(order, blocks, **mopd):
    return build_plan(ScheduleConfig.from_dict(
        {"order": order, "domains": {d: {"num_blocks": n} for d, n in blocks.items()}, **mopd}))


def replay_by(plan, stage):
    return [s for s in plan.stage_steps(stage) if s.kind == "replay"]


@FAST
@given(st.integers(0, 60), st.integers(1, 40))
def test_spread_in_range_sorted_with_endpoints(n, N):
    out = spread(n, N)
    assert len(out) == n and out == sorted(out)
    assert all(0 <= v < N for v in out)
    if n >= 2:
        assert out[0] == 0 and out[-1] == N - 1
    if n <= N:  # no block repeats while there are enough blocks
        assert len(set(out)) == n


@FAST
@given(sequences(), st.sampled_from(["seq", "shared", "fixed"]), st.integers(1, 6), st.integers(0, 8),
       st.integers(2, 8))
def test_sequence_invariants(seq, budget, m, b, f):
    order, blocks = seq
    plan = make(order, blocks, budget=budget, replay={"m": m, "b": b, "fixed_from_stage": f})
    K = len(order)
    assert plan.stages == list(range(1, K + 1))
    for k, d in enumerate(order, start=1):
        steps = plan.stage_steps(k)
        new = [s for s in steps if s.kind == "new"]
        # new-domain steps: every block of d once, in order, taught by E_d
        assert [(s.domain, s.block, s.teacher) for s in new] == [(d, i, f"expert:{d}") for i in range(blocks[d])]
        rep = replay_by(plan, k)
        for s in rep:  # replay: an earlier domain, a block in range, the frozen previous-stage student
            assert s.domain in order[: k - 1] and 0 <= s.block < blocks[s.domain] and s.teacher == f"student:{k - 1}"
        # S1: a stage keeps only E_k and M_{k-1}
        assert set(plan.held_by_stage[k]) == {f"expert:{d}", f"student:{k - 1}"}
        R, n = len(rep), blocks[d]
        if k == 1 or budget == "seq":
            assert R == 0
        elif budget == "shared" or k < f:
            assert R == n // m
            counts = Counter(s.domain for s in rep)  # cycling: counts of earlier domains differ by <= 1
            assert max(counts.values(), default=0) - min((counts[x] for x in order[: k - 1]), default=0) <= 1
        else:
            assert R == b * (k - 1)
            assert Counter(s.domain for s in rep) == Counter({x: b for x in order[: k - 1]} if b else {})
        # positions: after the t-th new step, exactly floor(t*R/n) replays have run (as even as possible)
        seen_new = seen_rep = 0
        for s in steps:
            if s.kind == "new":
                seen_new += 1
                assert seen_rep == (seen_new - 1) * R // n
            else:
                seen_rep += 1
        assert seen_rep == R
        # within a stage each domain's replay blocks are consumed in ascending order
        for x in order[: k - 1]:
            blk = [s.block for s in rep if s.domain == x]
            assert blk == sorted(blk)


@FAST
@given(sequences(min_k=3), st.integers(1, 6), st.integers(2, 5))
def test_fixed_share_spreads_blocks_evenly_across_stages(seq, b, f):
    order, blocks = seq
    K = len(order)
    plan = make(order, blocks, budget="fixed", replay={"b": b, "fixed_from_stage": f})
    for j, d in enumerate(order, start=1):
        stages = [k for k in range(max(f, j + 1), K + 1)]
        if not stages:
            continue
        per_stage = [[s.block for s in replay_by(plan, k) if s.domain == d] for k in stages]
        assert all(len(x) == b for x in per_stage)  # exactly b steps per stage
        union = sorted(x for lst in per_stage for x in lst)
        n, N = len(union), blocks[d]
        if n <= N:  # different stages revisit different prompts
            assert len(set(union)) == n
        if n >= 2:  # the union covers the domain evenly: first and last block, gaps <= ceil((N-1)/(n-1))
            assert union[0] == 0 and union[-1] == N - 1
            assert max(y - x for x, y in zip(union, union[1:])) <= ceil((N - 1) / (n - 1))
        # round-robin deal: the s-th block of each stage comes from consecutive pool entries
        for i in range(b):
            col = [lst[i] for lst in per_stage]
            assert col == sorted(col)


@FAST
@given(sequences(), st.integers(1, 5), st.sampled_from(["snapshots", "experts"]),
       st.sampled_from(["seq", "shared", "fixed"]))
def test_recovery_invariants(seq, c, teachers, budget):
    order, blocks = seq
    c = min(c, min(blocks.values()))
    K = len(order)
    plan = make(order, blocks, budget=budget, setting="S2",
                recovery={"enabled": True, "teachers": teachers, "blocks_per_domain": c})
    rec = plan.stage_steps(K + 1)
    assert len(rec) == K * c and all(s.kind == "recovery" for s in rec)
    assert [s.domain for s in rec] == [order[i % K] for i in range(K * c)]
    for k, d in enumerate(order, start=1):
        blk = [s.block for s in rec if s.domain == d]
        assert blk == spread(c, blocks[d]) and len(set(blk)) == c
        want = f"expert:{d}" if teachers == "experts" else f"student:{k}"
        assert {s.teacher for s in rec if s.domain == d} == {want}
    held = set(plan.held_by_stage[K + 1])
    if teachers == "snapshots":
        assert held == {f"student:{k}" for k in range(1, K + 1)}  # M_1..M_K
    else:
        assert held == {f"student:{K}"} | {f"expert:{d}" for d in order}


@FAST
@given(sequences(min_k=1), st.integers(1, 3), st.permutations(list(range(7))))
def test_joint_covers_every_block_once_per_pass(seq, passes, perm):
    order, blocks = seq
    jorder = [order[i] for i in perm if i < len(order)]
    plan = make(order, blocks, setting="S2", joint={"enabled": True, "passes": passes, "order": jorder})
    assert Counter((s.domain, s.block) for s in plan.steps) == Counter(
        {(d, i): passes for d in order for i in range(blocks[d])})
    assert set(plan.held_by_stage[1]) == {"student:0"} | {f"expert:{d}" for d in order}


@FAST
@given(sequences(min_k=2, max_k=9), st.integers(1, 4), st.integers(1, 3), st.integers(0, 3))
def test_segments_bounded_teachers_and_one_segment_equals_s2(seq, size, c, b):
    order, blocks = seq
    c = min(c, min(blocks.values()))
    common = dict(budget="fixed", replay={"b": b}, recovery={"enabled": True, "blocks_per_domain": c})
    plan = make(order, blocks, setting="S3", segments={"size": size}, **common)  # build_plan checks S3 holds
    K = len(order)
    n_seg = -(-K // size)
    rec_stages = sorted({s.stage for s in plan.steps if s.kind == "recovery"})
    assert len(rec_stages) == n_seg
    for g, st_ in enumerate(rec_stages):
        steps = plan.stage_steps(st_)
        learned = order[: min((g + 1) * size, K)]
        assert len(steps) == c * len(learned)
        assert len({s.teacher for s in steps}) <= size + 1  # bounded by the segment size
        if g > 0:  # earlier segments are taught by the previous consolidated model
            assert {s.teacher for s in steps if s.domain in order[: g * size]} == {f"student:{rec_stages[g - 1]}"}
    for s in plan.steps:  # replay never reaches back into an earlier segment
        if s.kind == "replay":
            new_d = next(x.domain for x in plan.stage_steps(s.stage) if x.kind == "new")
            assert order.index(s.domain) // size == order.index(new_d) // size
    if size >= K:
        assert plan.steps == make(order, blocks, setting="S2", **common).steps
