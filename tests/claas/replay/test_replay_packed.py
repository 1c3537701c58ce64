"""PackedEntries, the columnar wire format of a batch of step entries: exact round trip, the same buffer state as a
list of entries, vectorised validation that names the entry and the field, and all-or-nothing rejection."""

import dataclasses

import numpy as np
import pytest

from claas_verl.claas.replay import PackedEntries, ReplayBuffer, ReplayEntry, ScenarioEntry, wire_format

FIELDS = ("uid", "scenario_id", "step_idx", "n_tokens", "behaviour_logprob", "reward", "feedback", "domain",
          "metadata", "P")


def _entries():
    return [
        ReplayEntry(uid="a", scenario_id=0, step_idx=0, prompt_ids=[1, 2, 3], response_ids=[4, 5],
                    behaviour_logprob=-0.5, reward=1.0, P=0, feedback="ok", domain="math", metadata={"t": 1}),
        ReplayEntry(uid="b", scenario_id=3, prompt_ids=[], response_ids=[9], behaviour_logprob=-2.0,
                    reward=None),  # grader error: dropped by the buffer
        ReplayEntry(uid="c", scenario_id=3, step_idx=2, prompt_ids=np.array([7, 8], np.int32),
                    response_ids=[6, 6, 6], behaviour_logprob=0.0, reward=-0.25, P=2),
    ]


def _view(e):
    return {f: getattr(e, f) for f in FIELDS} | {"prompt": e.prompt_ids.tolist(), "response": e.response_ids.tolist()}


def test_round_trip_is_exact_and_layout_is_prompt_then_response():
    entries = _entries()
    packed = PackedEntries.from_entries(entries)
    assert len(packed) == 3 and packed.tokens.tolist() == [1, 2, 3, 4, 5, 9, 7, 8, 6, 6, 6]
    assert packed.step_idx.tolist() == [0, -1, 2] and packed.P.tolist() == [0, -1, 2]
    assert packed.has_reward.tolist() == [True, False, True]
    back = packed.to_entries()
    assert [_view(e) for e in back] == [_view(e) for e in entries]
    for e in back:  # read-only views of ONE private copy, detached from the packed (e.g. object-store) buffer
        assert not e.prompt_ids.flags.writeable and not e.response_ids.flags.writeable
        assert not np.shares_memory(e.response_ids, packed.tokens)
    assert back[0].prompt_ids.base is back[2].response_ids.base  # one buffer for the whole batch
    back[0].metadata["t"] = 2
    assert entries[0].metadata == {"t": 1}  # metadata dicts are copied, not shared with the sender
    for e in back:
        e.validate()  # what the trusted construction skipped still holds


def test_buffer_state_is_the_same_as_for_a_list_of_entries():
    a, b = ReplayBuffer(b_max=2, b_min=1, a_max=1, seed=5), ReplayBuffer(b_max=2, b_min=1, a_max=1, seed=5)
    batch = [*_entries(), dataclasses.replace(_entries()[0], uid="d", P=None)]
    assert a.add(batch) == b.add(PackedEntries.from_entries(batch)) == 3
    # b_max=2: "a" was evicted by FIFO (so it is accepted again, and evicts "c"), "d" is still stored (skipped)
    assert a.add(batch[::3]) == b.add(PackedEntries.from_entries(batch[::3])) == 1
    assert a.stats() == b.stats()
    assert [(_view(x), x.seq) for x in a.entries()] == [(_view(y), y.seq) for y in b.entries()]
    assert [e.uid for e in a.sample(2)] == [e.uid for e in b.sample(2)]


def _bad(field, value, i=1):
    packed = PackedEntries.from_entries(_entries())
    if isinstance(getattr(packed, field), np.ndarray):
        getattr(packed, field)[i] = value
        return packed
    col = list(getattr(packed, field))
    col[i] = value
    return dataclasses.replace(packed, **{field: tuple(col)})


@pytest.mark.parametrize(
    ("packed", "match"),
    [
        (_bad("behaviour_logprob", np.nan), r"entries\[1\] \(uid='b'\): behaviour_logprob must be finite"),
        (_bad("behaviour_logprob", 3.0, i=2), r"entries\[2\] \(uid='c'\): behaviour_logprob is positive"),
        (_bad("reward", np.inf, i=0), r"entries\[0\] \(uid='a'\): reward must be finite"),
        (_bad("scenario_id", -1), r"entries\[1\] .*scenario_id must be >= 0"),
        (_bad("step_idx", -2), r"entries\[1\] .*step_idx"),
        (_bad("P", -5, i=2), r"entries\[2\] .*P \(policy version\)"),
        (_bad("response_lens", 0, i=0), r"entries\[0\] .*response_ids is empty"),
        (_bad("tokens", -3, i=7), r"entries\[2\] \(uid='c'\): token ids must be >= 0"),
        (_bad("uid", ""), r"entries\[1\]: uid must be a non-empty str"),
        (_bad("domain", 7), r"entries\[1\] .*domain must be a str or None"),
        (_bad("metadata", None, i=0), r"entries\[0\] .*metadata must be a dict"),
        (dataclasses.replace(PackedEntries.from_entries(_entries()), tokens=np.zeros(3, np.int32)),
         "tokens holds 3 ids but the lengths add up to 11"),
        (dataclasses.replace(PackedEntries.from_entries(_entries()), P=np.zeros(2, np.int64)),
         "P must be a 1-D array of 3 values"),
        (dataclasses.replace(PackedEntries.from_entries(_entries()), uid=("a", "b")),
         "uid must be a tuple of 3 values"),
        (dataclasses.replace(PackedEntries.from_entries(_entries()),
                             tokens=PackedEntries.from_entries(_entries()).tokens.astype(np.int64)),
         "tokens must be a 1-D int32 array"),
    ],
)
def test_malformed_batch_is_rejected_whole_naming_entry_and_field(packed, match):
    buf = ReplayBuffer(b_max=10, b_min=1, a_max=3)
    buf.add(ReplayEntry(uid="kept", scenario_id=0, prompt_ids=[1], response_ids=[2], behaviour_logprob=-1.0,
                        reward=0.0))
    before = buf.stats()
    with pytest.raises(ValueError, match=match):
        buf.add(packed)
    after = buf.stats()
    assert after.pop("rejected_batches") == before.pop("rejected_batches") + 1
    assert after == before and [e.uid for e in buf.entries()] == ["kept"]


def test_packed_batches_hold_steps_only():
    with pytest.raises(ValueError, match="PackedEntries packs ReplayEntry"):
        PackedEntries.from_entries([ScenarioEntry(steps=_entries()[:1])])
    buf = ReplayBuffer(b_max=4, b_min=1, a_max=0, entry_unit="scenario")
    with pytest.raises(ValueError, match="entry_unit='scenario'"):
        buf.add(PackedEntries.from_entries(_entries()))
    assert len(buf) == 0


def test_empty_batch_adds_nothing():
    buf = ReplayBuffer(b_max=4, b_min=1, a_max=0)
    assert buf.add(PackedEntries.from_entries([])) == 0 and len(buf) == 0


def test_wire_format_packs_step_batches_only():
    steps = _entries()
    packed = wire_format(steps)
    assert isinstance(packed, PackedEntries) and [e.uid for e in packed.to_entries()] == ["a", "b", "c"]
    scenario = [ScenarioEntry(steps=steps[:1])]
    assert wire_format(scenario) == scenario and wire_format([]) == []
