"""The optional packages a MOPD run's reward needs, checked before Ray starts.

verl scores every rollout with ``reward.custom_reward_function`` inside a Ray worker; the repository's reward
(``claas_verl/mopd/data/rewards.py``) imports a package of the ``eval`` extra for some data sources
(``reasoning_gym`` for the gym and logic domains, lm-eval's IFEval verifiers for ``ultradata/if``). Without the extra
the run dies with a
``ModuleNotFoundError`` deep in a worker, minutes after start. Here the ``data_source`` column of every prompt file
of the plan is read and each module its score imports is looked up (``importlib.util.find_spec``, nothing imported).
"""

from __future__ import annotations

import importlib.util
import os

from omegaconf import DictConfig

REWARDS = os.path.join("claas_verl", "mopd", "data", "rewards.py")
INSTALL = "pip install 'claas_verl[eval]'  (from a checkout: pip install -e '.[eval]', or make install-eval)"


def uses_repository_reward(cfg: DictConfig) -> bool:
    """Whether verl scores with ``claas_verl/mopd/data/rewards.py`` (a recipe's own reward file is not inspected)."""
    path = str((cfg.get("reward") or {}).get("custom_reward_function", {}).get("path") or "")
    return os.path.normpath(path).endswith(REWARDS)


def prompt_data_sources(path: str) -> list[str]:
    """The distinct ``data_source`` values of a verl prompt file (parquet), in first-seen order."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["data_source"]) if path.endswith(".parquet") else None
    if table is None or "data_source" not in table.column_names:
        return []
    return list(dict.fromkeys(str(v) for v in table.column("data_source").to_pylist()))


def missing_reward_modules(cfg: DictConfig, plan) -> list[str]:
    """One line per (domain, data source, module) whose module cannot be found (prompt and test files)."""
    from claas_verl.mopd.data.rewards import extra_modules

    if not uses_repository_reward(cfg):
        return []
    problems = []
    for d in plan.order:
        files = [str(p) for k in ("prompts", "test_prompts")
                 if (p := cfg.mopd.domains[d].get(k)) not in (None, "???") and os.path.exists(str(p))]
        sources = dict.fromkeys(s for f in files for s in prompt_data_sources(f))
        for source in sources:
            for module in extra_modules(source):
                if importlib.util.find_spec(module) is None:
                    problems.append(f"mopd.domains.{d}: data source {source!r} is scored with {module!r}, "
                                    "which is not installed")
    return list(dict.fromkeys(problems))


def check_reward_extras(cfg: DictConfig, plan) -> None:
    """Raise one ``ValueError`` naming every data source whose reward imports a missing optional package."""
    problems = missing_reward_modules(cfg, plan)
    if problems:
        raise ValueError(f"the reward ({REWARDS}) needs the eval extra:\n  - " + "\n  - ".join(problems)
                         + f"\n  install it: {INSTALL}")
