"""The schedule and plan of a composed MOPD recipe: where the pure planner (``claas_verl.schedule``) meets OmegaConf
and the prompt files.

:class:`~claas_verl.schedule.ScheduleConfig` takes a plain mapping and counts nothing itself. This module turns the
``mopd`` node of a recipe into that mapping (interpolations resolved, ``???`` kept) and hands it
:func:`count_prompt_rows`, which counts the rows of a domain's prompt file (``.parquet`` with pyarrow, ``.jsonl``,
or a ``.json`` list) when the domain gives no ``num_blocks``.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from claas_verl.schedule import Plan, ScheduleConfig, build_plan


def count_prompt_rows(prompts: str | Path, key: str = "prompts", base_dir: str | Path | None = None) -> int:
    """The prompts in a ``.parquet``, ``.jsonl`` (non-empty lines) or ``.json`` (a list) file; a relative path is
    taken from ``base_dir`` when one is given. ``key`` names the field in the errors."""
    p = Path(prompts)
    if base_dir is not None and not p.is_absolute():
        p = Path(base_dir) / p
    if not p.is_file():
        raise ValueError(f"{key}: prompt file {str(p)!r} does not exist; fix the path or set num_blocks")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # here: reading a plan of num_blocks-only recipes needs no pyarrow

        return pq.ParquetFile(p).metadata.num_rows
    if suffix == ".jsonl":
        with p.open() as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".json":
        data = json.loads(p.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{key}: {p.name} must hold a JSON list of prompts")
        return len(data)
    raise ValueError(f"{key}: cannot count prompts in {p.name!r} (use .parquet or .jsonl, or set num_blocks)")


def schedule_from_dict(mopd: Any, base_dir: str | Path | None = None) -> ScheduleConfig:
    """:meth:`ScheduleConfig.from_dict` that counts the prompt files of domains without ``num_blocks`` (relative
    paths from ``base_dir``, else the working directory)."""
    return ScheduleConfig.from_dict(mopd, count_rows=partial(count_prompt_rows, base_dir=base_dir))


def schedule_from_recipe(mopd_node: Any) -> ScheduleConfig:
    """The schedule of the ``mopd`` node of a composed config (interpolations resolved, ``???`` kept)."""
    if mopd_node is None:
        raise ValueError("mopd: the config has no `mopd` section; compose a recipe under recipes/mopd/")
    return schedule_from_dict(OmegaConf.to_container(mopd_node, resolve=True, throw_on_missing=False))


def plan_from_config(root: Any) -> Plan:
    """Plan of a composed recipe (an OmegaConf node with a ``mopd`` section)."""
    return build_plan(schedule_from_recipe(root.get("mopd") if hasattr(root, "get") else None))

