"""Entries held by reference without Ray processes: RefBatch columns -> EntryRefs, buffer semantics, materialize."""

import numpy as np
import pytest

from claas_verl.claas.replay import BatchHandle, EntryRef, PackedEntries, RefBatch, ReplayBuffer, ReplayEntry


def _entries(tag, n, prompt=3, response=2, **kw):
    return [
        ReplayEntry(uid=f"{tag}{i}", scenario_id=i, step_idx=i, prompt_ids=np.arange(prompt) + 100 * i,
                    response_ids=np.arange(response) + 100 * i + 50, behaviour_logprob=-0.5 * (i + 1),
                    reward=float(i), feedback=f"fb{i}", domain="d", metadata={"i": i}, **kw)
        for i in range(n)
    ]


def _ref_batch(entries, ref="opaque"):
    packed = PackedEntries.from_entries(entries)
    handle = BatchHandle(ref, packed.tokens.shape[0], "node-0")
    return RefBatch(handle=handle, columns=packed.without_tokens()), packed.tokens


def test_entry_refs_point_at_the_right_rows_and_materialize_to_the_same_entries():
    src = _entries("a", 3, prompt=4, response=3)
    batch, tokens = _ref_batch(src)
    assert batch.columns.tokens.shape == (0,)  # the header carries no token
    refs = batch.to_entry_refs()
    assert [(r.offset, r.prompt_len, r.n_tokens) for r in refs] == [(0, 4, 3), (7, 4, 3), (14, 4, 3)]
    assert all(r.handle is batch.handle for r in refs) and refs[0].nbytes == 4 * 7
    for r, e in zip(refs, src):
        full = r.materialize(tokens)
        assert full.prompt_ids.tolist() == e.prompt_ids.tolist()
        assert full.response_ids.tolist() == e.response_ids.tolist()
        assert (full.uid, full.reward, full.behaviour_logprob, full.step_idx, full.feedback, full.metadata) == (
            e.uid, e.reward, e.behaviour_logprob, e.step_idx, e.feedback, e.metadata)


def test_buffer_holds_entry_refs_with_fifo_age_none_and_duplicate_rules():
    buf = ReplayBuffer(b_max=4, b_min=2, a_max=1, seed=0)
    src = _entries("a", 3)
    src[1].reward = None  # grader error: dropped before insertion
    batch, _ = _ref_batch(src)
    assert buf.add(batch) == 2 and buf.stats()["dropped_none"] == 1
    assert buf.add(batch) == 0 and buf.stats()["dropped_duplicate"] == 2  # a retried add is idempotent
    batch2, _ = _ref_batch(_entries("b", 3))
    assert buf.add(batch2) == 3 and len(buf) == 4  # FIFO: a0 evicted
    assert [e.uid for e in buf.entries()] == ["a2", "b0", "b1", "b2"]
    assert [h.node_id for h in buf.batch_handles()] == ["node-0", "node-0"]
    got = buf.sample(2)
    assert all(isinstance(e, EntryRef) and e.P == 0 for e in got)
    buf.on_update()
    assert buf.on_update() == 4 and buf.batch_handles() == []  # age eviction releases every handle
    assert buf.stats()["stored_nbytes"] == 0


def test_ref_batch_header_is_validated_all_or_nothing_with_field_names():
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=1)
    src = _entries("a", 2)
    packed = PackedEntries.from_entries(src)
    header = packed.without_tokens()
    bad_len = RefBatch(handle=BatchHandle("r", packed.tokens.shape[0] - 1), columns=header)
    with pytest.raises(ValueError, match="tokens holds 9 ids but the lengths add up to 10"):
        buf.add(bad_len)
    header.behaviour_logprob[1] = 2.0  # an NLL where a log-prob belongs
    with pytest.raises(ValueError, match=r"entries\[1\] \(uid='a1'\): behaviour_logprob"):
        buf.add(RefBatch(handle=BatchHandle("r", packed.tokens.shape[0]), columns=header))
    with pytest.raises(ValueError, match="BatchHandle"):
        buf.add(RefBatch(handle="not a handle", columns=packed.without_tokens()))
    assert len(buf) == 0 and buf.stats()["rejected_batches"] == 3
    scen = ReplayBuffer(b_max=10, b_min=1, a_max=1, entry_unit="scenario")
    with pytest.raises(ValueError, match="RefBatch holds step entries"):
        scen.add(_ref_batch(src)[0])


def test_entry_ref_validate_names_the_field():
    batch, _ = _ref_batch(_entries("a", 1))
    ref = batch.to_entry_refs()[0]
    ref.validate()
    ref.offset = 3  # the row would run past the 5-id buffer
    with pytest.raises(ValueError, match="runs past the batch buffer"):
        ref.validate()
    ref.offset, ref.reward = 0, float("inf")
    with pytest.raises(ValueError, match="reward"):
        ReplayBuffer(b_max=2, b_min=1, a_max=0).add([ref])
