"""Thin glue between claas_verl's pure math and verl's extension points.

``register_all()`` imports the modules whose decorators put claas_verl's
losses and advantage estimators into verl's registries. It is idempotent and
runs when verl's ``core_algos`` module is imported, scheduled by ``import
claas_verl`` and by the ``verl.plugins`` entry point, so the names also exist
inside every Ray worker.
"""

from __future__ import annotations

import importlib

# One module per capability; each registers its names at import time.
_REGISTRATION_MODULES = (
    "claas_verl.claas.verl_losses",
    "claas_verl.mopd.verl_losses",
)


def register_all() -> None:
    for name in _REGISTRATION_MODULES:
        importlib.import_module(name)


def register_when_verl_loads() -> None:
    """Schedule :func:`register_all` for the moment ``verl.trainer.ppo.core_algos`` is imported."""
    from claas_verl.verl_ext.import_hooks import when_imported

    when_imported("verl.trainer.ppo.core_algos", lambda _module: register_all())
