"""Where claas_verl finds its Hydra recipes (one place for every entry point)."""

from __future__ import annotations

import os
from pathlib import Path

RECIPES_ENV = "CLAAS_VERL_RECIPES"


def recipes_dir() -> Path:
    """The Hydra recipes folder: ``$CLAAS_VERL_RECIPES`` if set, else the repository's ``recipes/``.

    The recipes live beside the package (an editable install or a Ray ``working_dir`` upload of the
    repository); a deployment that ships them elsewhere points the variable at them.
    """
    env = os.environ.get(RECIPES_ENV)
    path = Path(env).resolve() if env else Path(__file__).resolve().parents[1] / "recipes"
    if not path.is_dir():
        raise FileNotFoundError(
            f"claas_verl recipes folder {path} not found: run from a checkout of the repository "
            f"(pip install -e .) or set {RECIPES_ENV} to the folder holding recipes/mopd and recipes/claas."
        )
    return path
