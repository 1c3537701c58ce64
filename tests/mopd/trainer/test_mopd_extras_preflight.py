"""The optional packages the reward needs for a recipe's data sources are checked before Ray starts: a gym recipe
without the ``eval`` extra stops at once with the data source, the module and the ``pip install`` that fixes it,
instead of a ``ModuleNotFoundError`` in a Ray reward worker minutes into the run."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from claas_verl.mopd.data.extras import missing_reward_modules
from claas_verl.mopd.recipe_schedule import plan_from_config
from claas_verl.paths import recipes_dir

GYM_SOURCES = {"spell": "reasoning_gym/spell_backward", "reverse": "reasoning_gym/letter_jumble",
               "palin": "reasoning_gym/palindrome_generation"}


def gym_run(gym_dir, *overrides: str):
    """``python -m claas_verl.main_mopd --config-name mopd/seq scale=gym +verl@_global_=cpu`` on prompt files (only the
    data_source column matters here) under ``gym_dir``."""
    from claas_verl.main_mopd import runtime_args

    for d, source in GYM_SOURCES.items():
        (gym_dir / "data" / d).mkdir(parents=True)
        for split in ("train", "test"):
            pd.DataFrame({"data_source": [source] * 2, "prompt": [[{"role": "user", "content": "x"}]] * 2}
                         ).to_parquet(gym_dir / "data" / d / f"{split}.parquet")
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        return compose(config_name="mopd/seq",
                       overrides=["scale=gym", *runtime_args([], group="cpu"), f"gym_dir={gym_dir}", *overrides])


def test_gym_recipe_without_reasoning_gym_fails_before_ray(tmp_path, monkeypatch):
    from claas_verl.main_mopd import finalize_config

    cfg = gym_run(tmp_path)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # find_spec answers None: as if not installed
    with pytest.raises(ValueError) as err:
        finalize_config(cfg)
    msg = str(err.value)
    assert msg.startswith("the reward (claas_verl/mopd/data/rewards.py) needs the eval extra")
    for d, source in GYM_SOURCES.items():
        assert f"mopd.domains.{d}: data source {source!r} is scored with 'reasoning_gym', which is not installed" in msg
    assert "pip install 'claas_verl[eval]'" in msg


def test_installed_extras_and_other_rewards_pass(tmp_path, monkeypatch):
    cfg = gym_run(tmp_path)
    plan = plan_from_config(cfg)
    assert missing_reward_modules(cfg, plan) == []  # reasoning_gym is installed in the test environment
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    cfg.reward.custom_reward_function.path = "recipes/ppo/tiny_reward.py"  # a reward the check does not know
    assert missing_reward_modules(cfg, plan) == []


def test_ifeval_rows_need_lm_eval(tmp_path, monkeypatch):
    from claas_verl.mopd.data.rewards import extra_modules

    assert extra_modules("ultradata/if") == ("lm_eval", "langdetect", "immutabledict")
    assert extra_modules("claas_tiny/logic") == () and extra_modules("math_dapo") == ()
    cfg = gym_run(tmp_path)
    pd.DataFrame({"data_source": ["ultradata/if"]}).to_parquet(tmp_path / "data" / "palin" / "test.parquet")
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert missing_reward_modules(cfg, plan_from_config(cfg)) == [
        "mopd.domains.palin: data source 'ultradata/if' is scored with 'lm_eval', which is not installed"]
