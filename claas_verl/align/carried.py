"""Carried balancing: an opt-in approximation of eqs. (9)-(10) at one backward per micro-batch (docs/math.md §B.6,
"Carried balancing").

Exact balancing writes the step gradient as a linear combination of the raw per-term gradients,

    g = α_tok·g_tok + α_SATS·g_SATS + α_VR·g_VR + α_hid·g_hid,

whose multipliers α come from the norms and inner products of those gradients (``mult_*`` in the metrics of
:func:`claas_verl.align.balanced_backward` and of :meth:`claas_verl.align.balance.HostBalancer.finish`). Once α is
known, g is the gradient of ONE loss, ``Σ_t α_t·ℓ_t``: one backward instead of one per term, and no per-term
gradient is ever held. The carried mode takes α from the last exact step of the same key (the replay domain, or
what stands for it) and reuses it for the next ``refresh - 1`` steps of that key; the first step of a key, and every
``refresh``-th one after it, is exact and records a new α.

Pure python bookkeeping; the backward itself is ``balanced_backward(..., multipliers=...)`` or the MOPD worker's
carried step.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

import torch

MULT_PREFIX = "mult_"


class CarriedBalance:
    """Per key: the multipliers of the last exact step and how many carried steps have used them.

    Usage per replay step of key ``d``::

        mults = carried.plan(d)                      # None: this step must be exact
        metrics = balanced_backward(..., multipliers=mults)
        if mults is None:
            carried.record(d, metrics)               # keeps the mult_* entries

    ``refresh = 1`` makes every step exact (the carried mode then equals exact balancing).
    """

    def __init__(self, refresh: int):
        if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
            raise ValueError(f"refresh must be an integer >= 1 (1 = every step exact); got {refresh!r}")
        self.refresh = refresh
        self._mults: dict[Hashable, dict[str, float]] = {}
        self._uses: dict[Hashable, int] = {}

    def plan(self, key: Hashable) -> dict[str, float] | None:
        """The multipliers for a carried step of ``key``, or None when the step must be exact (counts the use)."""
        mults = self._mults.get(key)
        if mults is None or self._uses[key] >= self.refresh - 1:
            return None
        self._uses[key] += 1
        return dict(mults)

    def record(self, key: Hashable, metrics: Mapping[str, float]) -> dict[str, float] | None:
        """Keep the ``mult_*`` entries of an exact step's metrics for ``key``; returns them.

        A step that fell back (``fallback``/``balance_fallback`` ≠ 0: a zero token or auxiliary gradient) or whose
        token multiplier is 0 is not carried: its α would repeat a degenerate step; the key's next step is exact.
        """
        mults = {k: float(v) for k, v in metrics.items() if k.startswith(MULT_PREFIX)}
        if "mult_tok" not in mults:
            raise ValueError(f"metrics of an exact balanced step must hold mult_tok (got keys {sorted(metrics)})")
        bad = [k for k, v in mults.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"non-finite multipliers {bad} from the exact step: refusing to carry them")
        fallback = float(metrics.get("fallback", metrics.get("balance_fallback", 0.0)))
        if fallback != 0.0 or mults["mult_tok"] == 0.0:
            self._mults.pop(key, None)
            self._uses.pop(key, None)
            return None
        self._mults[key] = mults
        self._uses[key] = 0
        return dict(mults)

    def state_dict(self) -> dict:
        return {"refresh": self.refresh, "mults": dict(self._mults), "uses": dict(self._uses)}

    def load_state_dict(self, state: Mapping) -> None:
        self.refresh = int(state["refresh"])
        self._mults = {k: dict(v) for k, v in state["mults"].items()}
        self._uses = dict(state["uses"])


def multiplier_errors(carried: Mapping[str, float], exact: Mapping[str, float]) -> dict[str, float]:
    """Per term ``|α_carried − α_exact| / |α_exact|`` (the relative error of that term's scale in g); 0/0 is 0."""
    out = {}
    for k, e in exact.items():
        if not k.startswith(MULT_PREFIX):
            continue
        c = float(carried.get(k, 0.0))
        out[k[len(MULT_PREFIX):]] = 0.0 if c == e == 0.0 else abs(c - e) / max(abs(e), 1e-300)
    return out


def gradient_cosine(a: list, b: list) -> float:
    """cos(a, b) of two per-parameter gradient lists (None = zeros), fp64 accumulation."""
    ab = aa = bb = 0.0
    for x, y in zip(a, b):
        if x is not None:
            aa += float(torch.sum(x.double() ** 2))
        if y is not None:
            bb += float(torch.sum(y.double() ** 2))
        if x is not None and y is not None:
            ab += float(torch.sum(x.double() * y.double()))
    return ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0
