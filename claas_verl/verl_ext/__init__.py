"""Thin glue between claas_verl's pure math and verl's extension points.

:func:`register_when_verl_loads` is the mechanism by which each system puts its own names into verl's registries:
a system's package (``claas_verl.claas``, ``claas_verl.mopd``) hands it a function that imports the system's
registration module, and the function runs the moment verl's ``core_algos`` module is imported (at once if it
already is). This layer knows neither system: ``import claas_verl`` imports both system packages (the edge's job),
and so does the ``verl.plugins`` entry point (it imports ``claas_verl`` as its parent package), so the names also
exist inside every Ray worker.
"""

from __future__ import annotations

from collections.abc import Callable

CORE_ALGOS = "verl.trainer.ppo.core_algos"  # where verl's policy-loss and advantage-estimator registries live


def register_when_verl_loads(register: Callable[[], None]) -> None:
    """Run ``register()`` once verl's ``core_algos`` is imported (now, if it already is), in this process.

    ``register`` imports the caller's registration module, whose ``@register_policy_loss`` /
    ``@register_adv_est`` decorators (:mod:`claas_verl.verl_ext.registry`) add its names; importing a module
    twice runs its decorators once, so scheduling it from several places is harmless.
    """
    from claas_verl.verl_ext.import_hooks import when_imported

    when_imported(CORE_ALGOS, lambda _core_algos: register())
