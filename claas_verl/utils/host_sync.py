"""What a loss may read on the host: the debug flag ``CLAAS_VERL_DEBUG_CHECKS=1`` and one read of its metrics.

Torch only.

A loss runs once per micro-batch, and reading a device tensor's value on the host (``bool(t.any())``,
``float(t)``, ``int(t.max())``, boolean indexing) waits for every kernel queued before it: one device stall per
check. So the losses (:mod:`claas_verl.losses`, :mod:`claas_verl.distill`, and their verl registrations) check
on every call only what the host already knows (shapes, dtypes, modes, Python numbers) and return their metrics
as 0-dim detached tensors, which the caller reduces to Python numbers once per step.

The checks that read values (NaN/inf at valid positions, token ids inside the vocabulary) run only when the flag
is on:

- ``CLAAS_VERL_DEBUG_CHECKS=1`` (also ``true``/``yes``/``on``) in the environment of the process that runs the
  loss, read on every call. The losses run in the Ray workers, so set it in their runtime env:
  ``+ray_kwargs.ray_init.runtime_env.env_vars.CLAAS_VERL_DEBUG_CHECKS=1``;
- or :func:`set_debug_checks` / the :func:`debug_checks` context manager in-process, which override the variable.

With the flag off, a NaN at a valid position still cannot pass silently into the weights: it makes the loss and
the gradient norm non-finite, and verl's actor then skips the optimizer step (it checks the grad norm); the flag
turns that into a ValueError naming the tensor at the loss that received it.

:func:`metrics_to_floats` reads a whole metrics dict in ONE host transfer. The verl registrations use it because
verl 0.9.1's ``ppo_loss`` wraps every metric in ``verl.utils.metric.Metric``, whose ``append`` calls ``.item()`` on a
tensor at once: a dict of k tensors would cost k syncs there, the floats of one stacked read cost one.
"""

from __future__ import annotations

import contextlib
import os

import torch

ENV_VAR = "CLAAS_VERL_DEBUG_CHECKS"
_TRUE = ("1", "true", "yes", "on")
_override: bool | None = None


def debug_checks_enabled() -> bool:
    """True when the value checks run: the in-process override if set, else ``$CLAAS_VERL_DEBUG_CHECKS``."""
    if _override is not None:
        return _override
    return os.environ.get(ENV_VAR, "").strip().lower() in _TRUE


def set_debug_checks(enabled: bool | None) -> None:
    """Turn the value checks on or off in this process; ``None`` defers to the environment variable again."""
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_debug_checks expects True, False or None; got {enabled!r}")
    _override = enabled


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Run a block with the value checks on (or off), restoring the previous setting afterwards."""
    previous = _override
    set_debug_checks(enabled)
    try:
        yield
    finally:
        set_debug_checks(previous)


def check_finite(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Debug flag on: raise ValueError if ``x`` holds NaN/inf where ``mask`` is set (everywhere if ``mask`` is None).

    Values on padding may be anything: the losses zero them before any math. With the flag off this returns at
    once (the check reads a value on the host: a device stall per call).
    """
    if not debug_checks_enabled():
        return
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask.bool()
    if bool(bad.any()):
        raise ValueError(
            f"{name} holds {int(bad.sum())} NaN/inf value(s) on valid (mask=1) positions; "
            f"fix the producer of {name} (a NaN loss would silently corrupt the update)."
        )


def metrics_to_floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """The same dict with every tensor value read as a Python float, in ONE host transfer (one sync, not one per key).

    Values must be 0-dim (or one-element) tensors on one device, or Python numbers (passed through). The floats equal
    ``float(value)`` of each tensor: the stack is in float64, which holds every float32/bf16/int value exactly.
    """
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return dict(metrics)
    for k in keys:
        if metrics[k].numel() != 1:
            raise ValueError(f"metric {k!r} must be a scalar tensor; got shape {tuple(metrics[k].shape)}")
    values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, values))}
