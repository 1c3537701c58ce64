"""``mopd.*`` has one default per key, in the recipes (``recipes/mopd/common/base.yaml``, ``recipes/mopd/train``):
the code reads no key with a fallback of its own that could disagree with them, and an unset key is named."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from claas_verl.preflight.models import plan_model_keys
from claas_verl.preflight.recipe_keys import TRAIN_YAML, recipe_key

PACKAGE = Path(__file__).resolve().parents[3] / "claas_verl"


def _defaulted_mopd_reads(path: Path) -> list[str]:
    """``<...mopd...>.get(key, default)`` calls in ``path`` (``MISSING``, a sentinel that raises, is no default)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"):
            continue
        receiver = ast.unparse(node.func.value)
        default = node.args[1] if len(node.args) > 1 else None
        if "mopd" in receiver and default is not None and ast.unparse(default) != "MISSING":
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_mopd_key_is_read_with_a_code_default():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _defaulted_mopd_reads(path)]
    assert not found, "read these keys with claas_verl.preflight.recipe_keys.recipe_key (default in the YAML):\n" + \
        "\n".join(found)


def test_an_unset_key_is_named_with_the_file_that_holds_its_default():
    mopd = OmegaConf.create({"train": {"teacher_dtype": "fp32"}, "eval": {"enabled": False}})
    assert recipe_key(mopd, "train.teacher_dtype", TRAIN_YAML) == "fp32"
    assert recipe_key(mopd, "eval.enabled") is False  # a false value is a value, not "unset"
    with pytest.raises(ValueError, match=r"mopd.train.fresh_optimizer_per_stage is not set: compose "
                                         r"recipes/mopd/train/paper.yaml"):
        recipe_key(mopd, "train.fresh_optimizer_per_stage", TRAIN_YAML)


def test_preflight_does_not_guess_whether_the_forgetting_evaluation_runs():
    plan = SimpleNamespace(steps=[SimpleNamespace(teacher="expert:spell")], order=["spell", "reverse"])
    cfg = OmegaConf.create({"mopd": {"student": "s", "eval": {"enabled": False}}})
    assert plan_model_keys(cfg, plan) == ["mopd.student", "mopd.domains.spell.expert"]
    cfg.mopd.eval.enabled = True  # the forgetting table compares against every domain's expert
    assert plan_model_keys(cfg, plan) == ["mopd.student", "mopd.domains.spell.expert", "mopd.domains.reverse.expert"]
    with pytest.raises(ValueError, match="mopd.eval.enabled is not set: compose recipes/mopd/common/base.yaml"):
        plan_model_keys(OmegaConf.create({"mopd": {"student": "s"}}), plan)

