"""Strict registration into verl's registries.

verl's ``register_policy_loss`` overwrites an existing name silently; a
package that silently replaced e.g. ``vanilla`` would change every user's
training without a word. These wrappers raise on a clash with a *different*
function and are idempotent for the same one (identified by module and
qualified name, so a re-import in a Ray worker or a test reload is fine).
"""

from __future__ import annotations

from collections.abc import Callable


def _ident(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: add ``fn`` to verl's policy-loss registry under ``name``; raise on a clash."""
    from verl.trainer.ppo import core_algos

    def decorator(fn: Callable) -> Callable:
        existing = core_algos.POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and _ident(existing) != _ident(fn):
            raise ValueError(
                f"verl policy loss {name!r} is already registered by {_ident(existing)}; "
                f"claas_verl refuses to overwrite it with {_ident(fn)}. Rename one of them."
            )
        core_algos.POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def register_adv_est(name: str) -> Callable[[Callable], Callable]:
    """Decorator: add ``fn`` to verl's advantage-estimator registry under ``name``; raise on a clash."""
    from verl.trainer.ppo import core_algos

    def decorator(fn: Callable) -> Callable:
        existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and _ident(existing) != _ident(fn):
            raise ValueError(
                f"verl advantage estimator {name!r} is already registered by {_ident(existing)}; "
                f"claas_verl refuses to overwrite it with {_ident(fn)}. Rename one of them."
            )
        core_algos.ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator
