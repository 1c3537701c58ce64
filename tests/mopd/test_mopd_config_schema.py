"""The MOPD schema owns every ``mopd.*`` default and its help text, and the recipes that hold the defaults repeat
exactly them (every key, no key more, no value different); verl's keys are derived from ``mopd.*`` in one place
(``recipes/mopd/verl/``) and a verl key set apart from its ``mopd`` key is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from schema_yaml import schema_yaml_diff

from claas_verl.mopd.config import EvalConfig, MopdConfig
from claas_verl.mopd.config_signal import SignalSection
from claas_verl.mopd.config_train import VERL_KEYS, TrainConfig
from claas_verl.schedule import ScheduleConfig
from claas_verl.utils.schema import schema_defaults, schema_rows

REPO = Path(__file__).resolve().parents[2]
MOPD = REPO / "recipes" / "mopd"


def _yaml(path: Path, section: str) -> dict:
    return OmegaConf.to_container(OmegaConf.select(OmegaConf.load(path), section), resolve=False)


def _base_schema() -> dict:
    """What ``recipes/mopd/common/base.yaml`` sets under ``mopd``: the run's own keys and the planner's."""
    own = schema_defaults(MopdConfig, skip=lambda cls, name: cls is MopdConfig and name in (
        "student", "domains", "train", "signal", "schedule"))
    plan = schema_defaults(ScheduleConfig, skip=lambda cls, name: cls is ScheduleConfig and name in (
        "order", "domains", "block_size"))
    return {**own, **plan}


def test_the_train_recipe_sets_every_train_key_at_its_default():
    yaml = _yaml(MOPD / "train" / "paper.yaml", "mopd.train")
    assert schema_yaml_diff(schema_defaults(TrainConfig), yaml, "mopd.train") == []


def test_the_base_recipe_sets_every_base_key_at_its_default():
    assert schema_yaml_diff(_base_schema(), _yaml(MOPD / "common" / "base.yaml", "mopd"), "mopd") == []


def test_the_signal_base_sets_every_signal_key_at_its_default():
    yaml = _yaml(MOPD / "signal" / "kl.yaml", "mopd.signal")
    assert schema_yaml_diff(schema_defaults(SignalSection), yaml, "mopd.signal") == []


def test_the_diff_fails_on_a_missing_an_extra_and_a_different_key():
    yaml = _yaml(MOPD / "train" / "paper.yaml", "mopd.train")
    yaml["lr"], yaml["extra"] = 2e-5, 1
    del yaml["betas"]
    assert schema_yaml_diff(schema_defaults(TrainConfig), yaml, "mopd.train") == [
        "mopd.train.betas: in the schema, not in the YAML",
        "mopd.train.extra: in the YAML, not in the schema",
        "mopd.train.lr: schema 1e-05, YAML 2e-05",
    ]


def test_the_schema_reads_every_train_key():
    """Every key of ``mopd.train`` is a field (25 keys): none is only an alias in the recipes."""
    yaml = _yaml(MOPD / "train" / "paper.yaml", "mopd.train")
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(yaml)
    assert TrainConfig.from_mapping(yaml.__getitem__) == TrainConfig()
    assert EvalConfig() == EvalConfig(True, 4, 4)


def test_every_key_has_help_text():
    for cls in (MopdConfig, TrainConfig, EvalConfig, SignalSection, ScheduleConfig):
        rows = list(schema_rows(cls, "mopd", skip=lambda owner, name: name in ("signal", "schedule", "domains")
                                and owner in (MopdConfig, ScheduleConfig)))
        assert rows and all(help_text.strip() for *_, help_text in rows), cls


def _interpolations(node, prefix: str = ""):
    """``(verl key, mopd key)`` of every ``${mopd.<key>}`` value of a runtime YAML."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _interpolations(value, f"{dotted}.")
        elif isinstance(value, str) and value.startswith("${mopd.") and value.endswith("}"):
            yield dotted, value[len("${mopd."):-1]


def test_the_verl_keys_are_derived_in_the_runtime_group_exactly_as_listed():
    found = set()
    for path in sorted((MOPD / "verl").glob("*.yaml")):
        found |= set(_interpolations(OmegaConf.to_container(OmegaConf.load(path), resolve=False)))
    listed = {(verl, mopd) for mopd, verls in VERL_KEYS.items() for verl in verls}
    assert found == listed


@pytest.fixture(scope="module")
def tiny_seq_cpu(tmp_path_factory):
    """``mopd/seq scale=tiny`` composed as main_mopd composes it (recipe + CPU runtime group)."""
    from hydra import compose, initialize_config_dir

    from claas_verl.main_mopd import runtime_args
    from claas_verl.paths import recipes_dir

    tiny = tmp_path_factory.mktemp("tiny")
    args = [*runtime_args(["+verl@_global_=cpu"]), "+verl@_global_=cpu", "scale=tiny", f"tiny_dir={tiny}"]
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        return compose(config_name="mopd/seq", overrides=args)


def test_the_composed_verl_keys_follow_the_mopd_keys(tiny_seq_cpu):
    mopd = MopdConfig.from_config(tiny_seq_cpu)
    assert mopd.train.lr == tiny_seq_cpu.actor_rollout_ref.actor.optim.lr == 2.0e-4
    assert mopd.train.student_param_dtype == "fp32" and mopd.eval.responses_per_prompt == 4


@pytest.mark.parametrize("verl_key, value, mopd_key", [
    ("actor_rollout_ref.actor.optim.lr", 0.5, "mopd.train.lr"),
    ("actor_rollout_ref.rollout.val_kwargs.n", 9, "mopd.eval.responses_per_prompt"),
    ("actor_rollout_ref.actor.optim.betas", [0.5, 0.5], "mopd.train.betas"),
])
def test_a_verl_key_set_apart_from_its_mopd_key_is_refused(tiny_seq_cpu, verl_key, value, mopd_key):
    cfg = OmegaConf.create(OmegaConf.to_container(tiny_seq_cpu, resolve=True))
    OmegaConf.update(cfg, verl_key, value)
    with pytest.raises(ValueError, match=rf"{verl_key}=.* differs from {mopd_key}=.*: set {mopd_key}"):
        MopdConfig.from_config(cfg)


@pytest.mark.parametrize("key, value, message", [
    ("lr", 0.0, r"mopd.train.lr=0.0: give a finite number > 0.0"),
    ("top_p", 1.5, r"mopd.train.top_p=1.5"),
    ("betas", [0.9], r"mopd.train.betas=\[0.9\]: give AdamW's two betas"),
    ("responses_per_prompt", 0, r"mopd.train.responses_per_prompt=0"),
    ("student_param_dtype", "int8", r"mopd.train.student_param_dtype='int8': choose one of"),
    ("ppo_epochs", 1.5, r"mopd.train.ppo_epochs=1.5"),
    ("lr_schedule", "linear", r"mopd.train.lr_schedule='linear': choose one of \['constant', 'cosine'\]"),
])
def test_a_bad_train_value_names_its_key(key, value, message):
    yaml = {**_yaml(MOPD / "train" / "paper.yaml", "mopd.train"), key: value}
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_mapping(yaml.__getitem__)
