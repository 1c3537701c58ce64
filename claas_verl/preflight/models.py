"""Every model a continual MOPD run loads, checked before Ray starts.

The student is loaded at start-up, but a teacher only when its stage begins (after Ray, the rollout servers and the
FSDP engines are up, possibly hours into the run), and the experts of every learned domain again for the forgetting
evaluation. A path left at ``???``, a Hugging Face hub id (each rank and each stage would download it, or fail
offline), or a directory without ``config.json`` is reported here, all of them in one error.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from claas_verl.preflight.recipe_keys import recipe_key

UNSET = "???"


def plan_model_keys(cfg: DictConfig, plan) -> list[str]:
    """Config keys of the models a run of ``plan`` loads: the student, then each expert a step teaches with or the
    forgetting evaluation (``mopd.eval.enabled``) compares against. The snapshots M_j are written by the run."""
    keys = ["mopd.student"]
    experts = [t.split(":", 1)[1] for t in dict.fromkeys(s.teacher for s in plan.steps) if t.startswith("expert:")]
    if bool(recipe_key(cfg.mopd, "eval.enabled")):
        experts += list(plan.order)
    keys += [f"mopd.domains.{d}.expert" for d in dict.fromkeys(experts)]
    return keys


def _value(cfg: DictConfig, key: str) -> str | None:
    parent, leaf = key.rsplit(".", 1)
    node = OmegaConf.select(cfg, parent)
    if node is None or leaf not in node or OmegaConf.is_missing(node, leaf):
        return None
    value = node[leaf]
    return None if value is None else str(value)


def model_path_problem(key: str, path: str | None) -> str | None:
    """Why ``path`` (the value of ``key``) is not a loadable local model, or None when it is."""
    if path in (None, "", UNSET):
        return f"{key} is unset ({UNSET}): set it to a local Hugging Face model directory"
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    if not os.path.isabs(path) and not path.startswith(".") and path.count("/") == 1 and not os.path.exists(path):
        return (f"{key}={path!r} is a Hugging Face hub id; runs load local directories only: download it first "
                f"(`huggingface-cli download {path} --local-dir DIR`) and set {key}=DIR")
    return f"{key}={path!r}: no Hugging Face model there (no config.json)"


def check_plan_models(cfg: DictConfig, plan) -> None:
    """Raise one ``ValueError`` naming every model of the plan that cannot be loaded (see the module doc)."""
    problems = [p for k in plan_model_keys(cfg, plan) if (p := model_path_problem(k, _value(cfg, k)))]
    if not problems:
        return
    tiny = OmegaConf.select(cfg, "tiny_dir", default=None)  # top-level: recipes/mopd/common/base.yaml
    hint = (f"\n  (tiny recipes: build the models first with `python -m claas_verl.tiny make {tiny}`)"
            if tiny and any(tiny in p for p in problems) else "")
    raise ValueError(f"{len(problems)} model path(s) of the plan cannot be loaded:\n  - " + "\n  - ".join(problems)
                     + hint)
