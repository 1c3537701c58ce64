"""``mopd.*`` keys read as the composed recipe sets them.

The MOPD schema (:mod:`claas_verl.mopd.config`) owns each key's default and help text; every MOPD recipe composes
``recipes/mopd/common/base.yaml`` (its first default) and one ``recipes/mopd/train`` group (each composes
``paper.yaml``), which repeat those defaults (``tests/mopd/test_mopd_config_schema.py`` holds them equal). A key the
composed recipe lacks raises naming the file that sets it, so a run never falls back to a value it did not show.
"""

from __future__ import annotations

BASE_YAML = "recipes/mopd/common/base.yaml"
TRAIN_YAML = "recipes/mopd/train/paper.yaml"

_UNSET = object()


def recipe_key(mopd, dotted: str, home: str = BASE_YAML):
    """``mopd.<dotted>`` of the OmegaConf node ``mopd``; an unset key raises naming it and the file (``home``) that
    holds its default."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(mopd, dotted, default=_UNSET)
    if value is _UNSET:
        raise ValueError(f"mopd.{dotted} is not set: compose {home} (every MOPD recipe composes it) or set "
                         f"mopd.{dotted} on the command line")
    return value
