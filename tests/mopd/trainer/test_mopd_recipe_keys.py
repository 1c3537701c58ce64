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

REPO = Path(__file__).resolve().parents[3]
CODE = [*(REPO / "claas_verl" / "schedule").rglob("*.py"), *(REPO / "claas_verl" / "mopd").rglob("*.py"),
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

    from claas_verl.paths import recipes_dir

    out = {}
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        for recipe in RECIPES:
            cfg = compose(config_name=f"mopd/{recipe}", overrides=[f"tiny_dir={tiny_dir}"])
            out[recipe] = set(_leaves(cfg.mopd, "mopd"))
    # the verl runtime groups (chosen by main_mopd) override the CPU precision keys; read their mopd
    # sections directly (composing verl's ppo_trainer costs seconds per recipe)
    for path in sorted((REPO / "recipes" / "mopd" / "verl").glob("*.yaml")):
        section = OmegaConf.load(path).get("mopd")
        if section is not None:
            out[f"verl/{path.stem}"] = set(_leaves(section, "mopd"))
    return out


def test_every_mopd_key_of_every_recipe_is_read(mopd_keys):
    assert set(RECIPES) < set(mopd_keys) and all(mopd_keys.values())
    assert "mopd.eval.prompts" in mopd_keys["seq"] and "mopd.train.teacher_dtype" in mopd_keys["fsar"]
    unread = {name: bad for name, keys in mopd_keys.items() if (bad := unread_keys(keys))}
    assert not unread, f"mopd.* keys that nothing reads (remove them or wire them): {unread}"


def test_the_check_flags_a_key_nothing_reads():
    assert unread_keys({"mopd.train.mini_batches_per_step", "mopd.train.lr", "mopd.signal.rho",
                        "mopd.domains.logic.expert"}) == ["mopd.train.mini_batches_per_step"]


# The only mopd.* keys a verl runtime group may set: the CPU preset runs everything in fp32.
RUNTIME_MOPD_KEYS = {"mopd.train.teacher_dtype", "mopd.train.student_param_dtype", "mopd.train.grad_reduce_dtype"}


def test_runtime_groups_override_no_recipe_setting():
    """main_mopd appends the runtime group (``+verl@_global_=cpu|gpu``) AFTER the recipe, so any mopd.* key it sets
    silently beats the recipe's own value. It did: ``mopd.eval.prompts: 4`` there overrode the gym benchmark's 48,
    and every stage-end accuracy of the continual benchmark was measured on 4 prompts instead of 48."""
    from omegaconf import OmegaConf

    for path in sorted((REPO / "recipes" / "mopd" / "verl").glob("*.yaml")):
        section = OmegaConf.load(path).get("mopd")
        keys = set(_leaves(section, "mopd")) if section is not None else set()
        assert keys <= RUNTIME_MOPD_KEYS, f"{path.name} sets {sorted(keys - RUNTIME_MOPD_KEYS)}: move them to " \
                                          f"recipes/mopd/common/base.yaml, where a recipe's groups can override them"


def test_gym_recipe_keeps_its_evaluation_size_under_the_runtime_group(tmp_path):
    """Composed exactly as main_mopd composes it (recipe + CPU runtime group): the data group's 48 x 4 survives."""
    from hydra import compose, initialize_config_dir

    from claas_verl.main_mopd import runtime_args
    from claas_verl.paths import recipes_dir

    args = [*runtime_args(["+verl@_global_=cpu"]), "+verl@_global_=cpu", f"gym_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        cfg = compose(config_name="mopd/seq", overrides=["scale=gym", *args])
    assert (cfg.mopd.eval.prompts, cfg.mopd.eval.responses_per_prompt) == (48, 4)
    assert cfg.actor_rollout_ref.rollout.val_kwargs.n == 4
    assert cfg.mopd.train.teacher_dtype == "fp32"  # the runtime group's own keys still apply
