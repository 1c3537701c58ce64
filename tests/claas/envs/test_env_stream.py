"""Scenario stream: deterministic shuffle by seed, K contiguous splits (docs/math.md §A.1.6)."""

import pytest

from claas_verl.claas.envs import RuleFollowingEnv, ScenarioStream


@pytest.fixture(scope="module")
def env():
    return RuleFollowingEnv(100, seed=0, num_turns=3)


def test_same_seed_same_stream_other_seed_other_order(env):
    a, b = env.stream(seed=7, num_splits=5), env.stream(seed=7, num_splits=5)
    assert a.ids() == b.ids()
    assert env.stream(seed=8, num_splits=5).ids() != a.ids()
    # a permutation of the pool, not the file order
    flat = [i for split in a.ids() for i in split]
    assert sorted(flat) == sorted(s.scenario_id for s in env.scenarios())
    assert flat != [s.scenario_id for s in env.scenarios()]


def test_splits_are_contiguous_and_sized(env):
    st = env.stream(seed=1, num_splits=5)
    assert st.split_size == 20 and len(st) == 100
    flat = [s.scenario_id for s in st]
    for j in range(5):
        assert [s.scenario_id for s in st.split(j)] == flat[20 * j:20 * (j + 1)]
    # 20 scenarios x 3 turns = 60 step entries at most per split (B_min warning input, docs/math.md §A.1.8)
    assert st.max_entries_per_split("step") == [60] * 5
    assert st.max_entries_per_split("scenario") == [20] * 5


def test_split_size_truncates_prefix_of_the_same_shuffle(env):
    full = env.stream(seed=2, num_splits=5)
    short = ScenarioStream(env.scenarios(), seed=2, num_splits=3, split_size=10)
    flat_full = [s.scenario_id for s in full]
    assert [s.scenario_id for s in short] == flat_full[:30]


def test_stream_independent_of_global_rng(env):
    import random

    random.seed(123)
    a = env.stream(seed=5, num_splits=4).ids()
    random.seed(999)
    assert env.stream(seed=5, num_splits=4).ids() == a


def test_stream_validation(env):
    with pytest.raises(ValueError, match="split_size"):
        env.stream(seed=0, num_splits=3)  # 100 % 3 != 0
    with pytest.raises(ValueError, match="exceeds"):
        env.stream(seed=0, num_splits=5, split_size=21)
    with pytest.raises(ValueError, match="num_splits"):
        env.stream(seed=0, num_splits=0)
    with pytest.raises(ValueError, match="split index"):
        env.stream(seed=0, num_splits=5).split(5)


def test_make_environment_by_name(tmp_path):
    from pathlib import Path

    from claas_verl.claas.envs import IHChallengeEnv, make_environment

    env = make_environment("rule_following", num_scenarios=6, seed=1, num_turns=2)
    assert len(env) == 6 and env.scenarios()[0].num_turns == 2
    sample = Path(__file__).resolve().parents[3] / "examples" / "data" / "ih_challenge_sample.jsonl"
    ih = make_environment("ih_challenge", path=sample, sandbox={"timeout_s": 2.0, "cpu_s": 2, "memory_mb": 256})
    assert isinstance(ih, IHChallengeEnv) and ih.limits.timeout_s == 2.0 and len(ih) == 4
    with pytest.raises(ValueError, match="unknown environment"):
        make_environment("nope")
    with pytest.raises(ValueError, match="bad arguments"):
        make_environment("rule_following", num_scenario=3)


# ---------------------------------------------------------------------------------------------- grouped splits
@pytest.fixture(scope="module")
def mixed():
    return RuleFollowingEnv(40, seed=0, num_turns=2, max_rules=1, families=["lowercase", "capital_start"])


def test_grouped_splits_draw_each_split_from_its_group_in_shuffled_order(mixed):
    groups = ["lowercase", "lowercase", "capital_start", "capital_start", "lowercase"]
    st = mixed.stream(seed=3, num_splits=5, split_size=4, split_groups=groups)
    for j, g in enumerate(groups):
        assert [s.meta["families"] for s in st.split(j)] == [[g]] * 4
    # without replacement, and in the order of the seed's shuffle of the whole pool
    order = [s.scenario_id for s in ScenarioStream(mixed.scenarios(), seed=3, num_splits=1, split_size=40)]
    low = [i for i in order if i in {s.scenario_id for s in mixed.scenarios() if s.meta["families"] == ["lowercase"]}]
    assert st.ids()[0] + st.ids()[1] + st.ids()[4] == low[:12]
    assert len({i for split in st.ids() for i in split}) == 20
    other = mixed.stream(seed=4, num_splits=5, split_size=4, split_groups=groups)
    assert other.ids() != st.ids()                    # the seed picks which scenarios land in which split
    assert mixed.stream(seed=3, num_splits=5, split_size=4, split_groups=groups).ids() == st.ids()


def test_grouped_splits_validation(mixed):
    n_low = sum(s.meta["families"] == ["lowercase"] for s in mixed.scenarios())
    with pytest.raises(ValueError, match=r"group 'lowercase' need .* but the pool has "
                                         rf"{n_low}.*raise claas.env.kwargs.num_scenarios"):
        mixed.stream(seed=0, num_splits=2, split_size=n_low, split_groups=["lowercase", "lowercase"])
    with pytest.raises(ValueError, match="one group per split"):
        mixed.stream(seed=0, num_splits=3, split_size=2, split_groups=["lowercase"])
    with pytest.raises(ValueError, match="'json'.*pool has 0"):
        mixed.stream(seed=0, num_splits=1, split_size=2, split_groups=["json"])
    with pytest.raises(ValueError, match=r"group_key.*meta\['topic'\]"):
        mixed.stream(seed=0, num_splits=1, split_size=2, split_groups=["lowercase"], group_key="topic")


def test_stream_config_validates_split_groups():
    from claas_verl.claas.trainer.config import StreamConfig

    assert StreamConfig(num_splits=2, split_size=3, split_groups=["a", "b"]).split_groups == ["a", "b"]
    with pytest.raises(ValueError, match="claas.stream.split_groups has 1 entries but num_splits is 2"):
        StreamConfig(num_splits=2, split_size=3, split_groups=["a"])
    with pytest.raises(ValueError, match="needs claas.stream.split_size"):
        StreamConfig(num_splits=1, split_size=None, split_groups=["a"])
