"""Every recipe name of the copy-per-variant layout composes, under its new spelling, the config its file composed.

``tests/fixtures/recipes_before_deltas/`` holds those files as they were (and the three group options that became
overrides). Each is composed in a copy of today's recipes/ laid out as before (the old files in place, the bases
without the defaults list they gained), so that both sides read today's groups and values; the new spelling is
composed from recipes/ itself. The two must be the same config, key for key, interpolations unresolved.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from recipe_spellings import SPELLINGS, split

from claas_verl.paths import recipes_dir

BEFORE = Path(__file__).resolve().parents[1] / "fixtures" / "recipes_before_deltas"
OLD_RECIPES = sorted(f"{p.parent.name}/{p.stem}" for p in BEFORE.glob("*/*.yaml"))


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory) -> Path:
    """recipes/ with the old recipe files back and each system's base without its defaults list (scale and groups)."""
    root = tmp_path_factory.mktemp("recipes_before") / "recipes"
    shutil.copytree(recipes_dir(), root)
    for base in ("mopd/common/base.yaml", "claas/common/base.yaml"):
        path = root / base
        text, n = re.subn(r"^defaults:\n(?:  - .*\n)+", "", path.read_text(), flags=re.M)
        assert n == 1, f"{base}: expected one defaults list"
        path.write_text(text)
    for old in BEFORE.rglob("*.yaml"):
        shutil.copy(old, root / old.relative_to(BEFORE))
    return root


def _composed(config_dir: Path, name: str, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return OmegaConf.to_container(compose(config_name=name, overrides=overrides), resolve=False)


def test_every_old_recipe_has_a_spelling_and_every_spelling_names_a_recipe():
    assert sorted(SPELLINGS) == OLD_RECIPES
    for spelling in SPELLINGS.values():
        assert (recipes_dir() / f"{split(spelling)[0]}.yaml").is_file(), spelling


def test_the_removed_recipes_are_gone():
    assert [o for o, s in SPELLINGS.items() if o != s and (recipes_dir() / f"{o}.yaml").exists()] == []


@pytest.mark.parametrize("old", OLD_RECIPES)
def test_new_spelling_composes_the_old_config(old, old_tree):
    name, overrides = split(SPELLINGS[old])
    new = _composed(recipes_dir(), name, overrides)
    before = _composed(old_tree, old, [])
    assert new == before


def test_scale_is_one_command_line_choice_with_a_clear_error_for_a_missing_one():
    tiny = _composed(recipes_dir(), "mopd/replay_kl", ["scale=tiny"])
    assert tiny["mopd"]["order"] == ["logic", "math", "code"] and tiny["mopd"]["budget"] == "shared"
    assert "claas" not in tiny  # MOPD's paths are its own keys (tiny_dir, gym_dir)
    with pytest.raises(Exception, match="claas/scale/gym"):
        _composed(recipes_dir(), "claas/sdpo", ["scale=gym"])


def test_the_continual_benchmark_runs_each_method_as_its_old_recipe():
    """benchmarks/continual.py keeps the old names as its methods' names (the committed results name them)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.continual_methods import SPELLINGS as METHODS

    assert {m: SPELLINGS[m] for m in METHODS} == METHODS
