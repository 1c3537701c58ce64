"""Every ``mopd.*`` key of every MOPD recipe is read somewhere: a key nothing reads is a setting that silently does
nothing (as ``mopd.train.mini_batches_per_step`` and the precision keys once were).

A key counts as read when a recipe maps it onto another key (``${mopd.<path>}`` interpolation, e.g. onto verl's
actor config) or when the MOPD code (planner, trainer, entry point) reads its name (``.name``, ``"name"``,
``'name'``, or ``get("name"``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig

REPO = Path(__file__).resolve().parents[2]
CODE = [*(REPO / "claas_verl" / "schedule").rglob("*.py"), *(REPO / "claas_verl" / "trainer" / "mopd").rglob("*.py"),
        REPO / "claas_verl" / "main_mopd.py", REPO / "claas_verl" / "plan.py"]
RECIPES = sorted(p.stem for p in (REPO / "recipes" / "mopd").glob("*.yaml"))
# per-domain maps: their children are read through the domain name (mopd.domains[d].<key>)
DOMAIN_MAPS = ("mopd.domains",)


def _leaves(node, prefix: str):
    if isinstance(node, DictConfig):
        for k in node.keys():
            yield from _leaves(node._get_node(k), f"{prefix}.{k}")
    elif isinstance(node, ListConfig):
        yield prefix  # a list value is one setting
    else:
        yield prefix


def unread_keys(paths: set[str]) -> list[str]:
    code = "\n".join(p.read_text() for p in CODE)
    yaml = "\n".join(p.read_text() for p in (REPO / "recipes").rglob("*.yaml"))
    bad = []
    for path in sorted(paths):
        if f"${{{path}}}" in yaml:
            continue
        parts = path.split(".")
        if path.startswith(DOMAIN_MAPS):
            parts = parts[:2] + parts[3:]  # mopd.domains.<d>.expert -> name "expert"
        name = re.escape(parts[-1])
        if re.search(rf"(\.{name}\b|[\"']{name}[\"'])", code):
            continue
        bad.append(path)
    return bad


@pytest.fixture(scope="module")
def mopd_keys(tiny_dir) -> dict[str, set[str]]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from claas_verl.schedule import recipes_dir

    out = {}
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        for recipe in RECIPES:
            cfg = compose(config_name=f"mopd/{recipe}", overrides=[f"claas.tiny_dir={tiny_dir}"])
            out[recipe] = set(_leaves(cfg.mopd, "mopd"))
    # the verl runtime groups (chosen by main_mopd) add mopd.eval and override mopd.train keys; read their mopd
    # sections directly (composing verl's ppo_trainer costs seconds per recipe)
    for path in sorted((REPO / "recipes" / "mopd" / "verl").glob("*.yaml")):
        section = OmegaConf.load(path).get("mopd")
        if section is not None:
            out[f"verl/{path.stem}"] = set(_leaves(section, "mopd"))
    return out


def test_every_mopd_key_of_every_recipe_is_read(mopd_keys):
    assert set(RECIPES) < set(mopd_keys) and all(mopd_keys.values())
    assert "mopd.eval.prompts" in mopd_keys["verl/common"] and "mopd.train.teacher_dtype" in mopd_keys["fsar"]
    unread = {name: bad for name, keys in mopd_keys.items() if (bad := unread_keys(keys))}
    assert not unread, f"mopd.* keys that nothing reads (remove them or wire them): {unread}"


def test_the_check_flags_a_key_nothing_reads():
    assert unread_keys({"mopd.train.mini_batches_per_step", "mopd.train.lr", "mopd.signal.rho",
                        "mopd.domains.logic.expert"}) == ["mopd.train.mini_batches_per_step"]
