"""The ``claas:`` schema (:class:`ClaasConfig` and its sections) owns every default and its help text, and
``recipes/claas/common/base.yaml`` repeats exactly those defaults: every key, no key more, no value different."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from schema_yaml import schema_yaml_diff

from claas_verl.claas.trainer.config import JOB_SET_SERVICE_FIELDS, ClaasConfig, ServiceSection
from claas_verl.utils.schema import schema_defaults, schema_rows

REPO = Path(__file__).resolve().parents[3]
BASE_YAML = REPO / "recipes" / "claas" / "common" / "base.yaml"


def _user_key(owner: type, name: str) -> bool:
    """Skip the service fields a job sets itself: a recipe may not set them."""
    return issubclass(owner, ServiceSection) and name in JOB_SET_SERVICE_FIELDS


def test_the_base_recipe_sets_every_schema_key_at_its_default():
    yaml = OmegaConf.to_container(OmegaConf.load(BASE_YAML).claas, resolve=False)
    schema = schema_defaults(ClaasConfig, skip=_user_key)
    # env.kwargs are the environment's own arguments (the paper's 100 scenarios), checked by the environment
    assert schema["env"]["kwargs"] == {} and set(yaml["env"]["kwargs"]) == {"num_scenarios", "seed", "num_turns"}
    schema["env"]["kwargs"] = yaml["env"]["kwargs"]
    assert schema_yaml_diff(schema, yaml, "claas") == []


def test_the_diff_names_missing_extra_and_different_keys():
    assert schema_yaml_diff({"a": 1, "s": {"b": 2, "c": 3}}, {"a": 1.0, "s": {"b": 2, "d": 4}, "e": 5}, "claas") == [
        "claas.a: schema 1, YAML 1.0",
        "claas.e: in the YAML, not in the schema",
        "claas.s.c: in the schema, not in the YAML",
        "claas.s.d: in the YAML, not in the schema",
    ]


def test_the_defaults_that_once_disagreed_are_the_recipe_values():
    """``ClaasConfig()`` built in Python behaves as a recipe run: B_min 32, 16 scenarios at once, 1024 tokens."""
    c = ClaasConfig()
    assert (c.b_min, c.producer.max_concurrent_scenarios, c.producer.max_new_tokens) == (32, 16, 1024)


def test_the_base_recipe_builds_the_schema_default():
    built = ClaasConfig.from_config(OmegaConf.load(BASE_YAML).claas)
    assert built == ClaasConfig(env=built.env)


def test_every_key_has_help_text():
    rows = list(schema_rows(ClaasConfig, "claas", skip=_user_key))
    assert len(rows) >= 70
    assert all(help_text.strip() for _, _, _, help_text in rows)
    keys = [key for key, *_ in rows]
    assert len(keys) == len(set(keys)) and "claas.service.record" not in keys


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="b_min = 64 must be <= b_max = 32"):
        ClaasConfig(b_min=64, b_max=32)
    assert ClaasConfig().unreachable_b_min(80) is None
    assert "claas.b_min = 32 exceeds the 20 entries" in ClaasConfig().unreachable_b_min(20)
