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


def _strict_register(registry_attr: str, kind: str, name: str) -> Callable[[Callable], Callable]:
    from verl.trainer.ppo import core_algos

    registry = getattr(core_algos, registry_attr)

    def decorator(fn: Callable) -> Callable:
        existing = registry.get(name)
        if existing is not None and _ident(existing) != _ident(fn):
            raise ValueError(
                f"verl {kind} {name!r} is already registered by {_ident(existing)}; "
                f"claas_verl refuses to overwrite it with {_ident(fn)}. Rename one of them."
            )
        registry[name] = fn
        return fn

    return decorator


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: add ``fn`` to verl's policy-loss registry under ``name``; raise on a clash."""
    return _strict_register("POLICY_LOSS_REGISTRY", "policy loss", name)


def register_adv_est(name: str) -> Callable[[Callable], Callable]:
    """Decorator: add ``fn`` to verl's advantage-estimator registry under ``name``; raise on a clash."""
    return _strict_register("ADV_ESTIMATOR_REGISTRY", "advantage estimator", name)
