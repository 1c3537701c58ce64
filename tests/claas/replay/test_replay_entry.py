"""ReplayEntry / ScenarioEntry construction and validation (docs/math.md §A.1.1, A.1.5)."""

import math
import pickle

import numpy as np
import pytest

from claas_verl.claas.replay import ReplayEntry, ScenarioEntry, aggregate_scenario_reward


def _entry(**overrides):
    kwargs = dict(scenario_id=0, prompt_ids=[5, 6], response_ids=[7, 8, 2], behaviour_logprob=-1.5, reward=1.0)
    kwargs.update(overrides)
    return ReplayEntry(**kwargs)


def test_lists_become_read_only_int32_arrays():
    e = _entry()
    assert e.prompt_ids.dtype == np.int32 and e.response_ids.dtype == np.int32
    np.testing.assert_array_equal(e.response_ids, [7, 8, 2])
    assert e.n_tokens == 3  # derived from len(response_ids)
    with pytest.raises(ValueError):
        e.response_ids[0] = 1  # read-only: stored copies share the array


def test_caller_array_is_not_frozen_or_aliased():
    ids = np.array([1, 2, 3], dtype=np.int32)
    e = _entry(response_ids=ids)
    ids[0] = 99  # the caller may keep using its array ...
    assert e.response_ids[0] == 1  # ... without changing the entry


def test_read_only_int32_array_is_used_without_copy():
    ids = np.array([1, 2, 3], dtype=np.int32)
    ids.flags.writeable = False
    assert _entry(response_ids=ids).response_ids is ids


def test_int64_array_and_empty_prompt_are_converted():
    e = _entry(prompt_ids=[], response_ids=np.array([4, 5], dtype=np.int64))
    assert e.prompt_ids.shape == (0,) and e.prompt_ids.dtype == np.int32
    assert e.response_ids.dtype == np.int32


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(response_ids=[]), "response_ids"),
        (dict(response_ids=[1.5, 2.0]), "response_ids"),
        (dict(prompt_ids=[[1, 2], [3, 4]]), "prompt_ids"),
        (dict(prompt_ids=[-1, 3]), "prompt_ids"),
        (dict(response_ids=[2**31]), "response_ids"),
        (dict(n_tokens=4), "n_tokens"),
        (dict(behaviour_logprob=math.nan), "behaviour_logprob"),
        (dict(behaviour_logprob=math.inf), "behaviour_logprob"),
        (dict(behaviour_logprob=2.0), "behaviour_logprob"),  # an NLL passed as a log-prob
        (dict(behaviour_logprob="x"), "behaviour_logprob"),
        (dict(reward=math.nan), "reward"),
        (dict(reward="1"), "reward"),
        (dict(scenario_id=-1), "scenario_id"),
        (dict(scenario_id=True), "scenario_id"),
        (dict(step_idx=-2), "step_idx"),
        (dict(uid=""), "uid"),
        (dict(P=-1), "P"),
        (dict(feedback=3), "feedback"),
        (dict(metadata=[1]), "metadata"),
    ],
)
def test_malformed_fields_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        _entry(**overrides)


def test_reward_none_is_a_valid_entry_and_small_positive_logprob_tolerated():
    assert _entry(reward=None).reward is None
    assert _entry(behaviour_logprob=5e-4).behaviour_logprob == 5e-4  # bf16 rounding slack, not a sign error


def test_mutated_entry_fails_revalidation():
    e = _entry()
    e.reward = math.inf
    with pytest.raises(ValueError, match="reward"):
        e.validate()


def test_pickle_round_trip_keeps_arrays():
    e = _entry(feedback="ok", domain="math", metadata={"a": 1}, step_idx=2, P=3)
    e2 = pickle.loads(pickle.dumps(e, protocol=5))
    np.testing.assert_array_equal(e2.prompt_ids, e.prompt_ids)
    assert (e2.uid, e2.feedback, e2.domain, e2.metadata, e2.step_idx, e2.P) == (e.uid, "ok", "math", {"a": 1}, 2, 3)
    e2.validate()


def test_uids_default_unique():
    assert _entry().uid != _entry().uid


@pytest.mark.parametrize(
    "agg, rewards, expected",
    [
        ("min", [1.0, 0.0, 1.0], 0.0),  # passes only if every graded turn passes
        ("mean", [1.0, 0.0, 1.0], 2.0 / 3.0),
        ("last", [1.0, 0.0, 0.5], 0.5),
        ("min", [1.0, None, 1.0], None),  # any None step drops the scenario
        ("last", [None, 1.0], None),
    ],
)
def test_aggregate_scenario_reward(agg, rewards, expected):
    out = aggregate_scenario_reward(rewards, agg)
    assert out == pytest.approx(expected) if expected is not None else out is None


def test_aggregate_scenario_reward_rejects_bad_mode_and_empty():
    with pytest.raises(ValueError, match="reward_agg"):
        aggregate_scenario_reward([1.0], "max")
    with pytest.raises(ValueError, match="empty"):
        aggregate_scenario_reward([], "min")


def _steps(rewards, versions=None, scenario_id=4):
    versions = versions or [None] * len(rewards)
    return [
        _entry(
            scenario_id=scenario_id,
            step_idx=t,
            reward=r,
            P=p,
            behaviour_logprob=-0.5 * (t + 1),
            response_ids=list(range(1, t + 3)),
        )
        for t, (r, p) in enumerate(zip(rewards, versions))
    ]


def test_scenario_entry_keeps_per_step_logprobs_and_tokens():
    s = ScenarioEntry(steps=_steps([1.0, 0.0, 1.0]))
    assert [st.behaviour_logprob for st in s.steps] == [-0.5, -1.0, -1.5]
    assert [st.n_tokens for st in s.steps] == [2, 3, 4]
    assert s.n_tokens == 9  # 2 + 3 + 4
    assert s.reward == 0.0 and s.scenario_id == 4
    assert ScenarioEntry(steps=_steps([1.0, 0.0, 1.0]), reward_agg="mean").reward == pytest.approx(2 / 3)
    assert ScenarioEntry(steps=_steps([1.0, None])).reward is None


def test_scenario_version_is_min_over_steps():
    # steps served by versions 5, 3, 4 -> P = 3; a step without a version counts as the buffer's k.
    assert ScenarioEntry(steps=_steps([1, 1, 1], [5, 3, 4])).resolve_version(current_k=9) == 3
    assert ScenarioEntry(steps=_steps([1, 1], [5, None])).resolve_version(current_k=2) == 2
    assert ScenarioEntry(steps=_steps([1, 1], [5, 6]), P=1).resolve_version(current_k=9) == 1


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ScenarioEntry(steps=[]), "steps"),
        (lambda: ScenarioEntry(steps=_entry()), "steps"),
        (lambda: ScenarioEntry(steps=[_entry(scenario_id=1), _entry(scenario_id=2)]), "scenario_id"),
        (lambda: ScenarioEntry(steps=[_entry(step_idx=1), _entry(step_idx=0)]), "step_idx"),
        (lambda: ScenarioEntry(steps=_steps([1.0]), reward_agg="median"), "reward_agg"),
        (lambda: ScenarioEntry(steps=[_entry(), "x"]), r"steps\[1\]"),
    ],
)
def test_scenario_entry_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()
