"""``mopd.signal``: the keys of the alignment terms on MOPD replay steps (docs/math.md §B.3-B.6), their defaults,
help text and validation (pure python: the config layer; the trainer's :mod:`claas_verl.mopd.trainer.alignment`
imports it).

:class:`SignalSection` is the schema of the YAML keys (``recipes/mopd/signal/kl.yaml`` repeats its defaults, held
equal by ``tests/mopd/test_mopd_config_schema.py``); :func:`aux_config` turns a ``mopd.signal`` mapping into the
validated :class:`AuxConfig` the trainer uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from claas_verl.utils.schema import knob

SIGNAL_TERMS = ("sats", "vr", "hidden")  # names of claas_verl.align.alignment_signals
COMBINE_VARIANTS = ("fsar", "1:1:1")  # mopd.signal.combine: eq. (10)+(9), or MOPD paper Table 4's 1:1:1
BALANCE_MODES = ("exact", "carried")  # mopd.signal.balance: exact eqs. (9)-(10) every step, or carried multipliers
# mopd.signal.passes: one forward per micro-batch for the token loss and every term (the floor), or verl's token
# pass then one forward + backward per term (the MOPD paper's separate passes; one gradient on the device)
PASS_SCHEDULES = ("shared", "separate")
AUX_STEP_KINDS = ("replay", "recovery")  # new-domain and joint steps never run the alignment terms (docs/math.md §B.6)


@dataclass(frozen=True)
class AuxConfig:
    """``mopd.signal`` of a recipe (``recipes/mopd/signal/*.yaml``), validated.

    Attributes:
        terms: enabled alignment terms, a subset of ``("sats", "vr", "hidden")`` in that order.
        ratio: r of eq. (9) (token : auxiliary gradient norm).
        rho: ρ of eq. (10) (weight of the hidden-state direction).
        window: W, the last W valid response tokens (B.3).
        layers: 0-based layers of every term, or None for all layers.
        drop_trailing: B.4 [CHOICE] flag: drop a final region that does not end with a separator.
        kinds: plan step kinds that run the balanced update: replay steps (docs/math.md §B.6). Recovery steps use the
            token loss only (docs/math.md §B.8, MOPD paper §5); ``aux_kinds: [replay, recovery]`` is an explicit
            deviation.
        combine: ``"fsar"`` (eq. 10 then eq. 9) or ``"1:1:1"`` (MOPD paper Table 4: ``g_tok + ‖g_tok‖ĝ_SATS +
            ‖g_tok‖ĝ_other``, with SATS and exactly one of VR / hidden).
        target_budget_gib: host RAM per rank for the teacher's alignment targets of a step
            (``mopd.signal.target_budget_gib``); micro-batches beyond it are streamed
            (:class:`claas_verl.align.target_store.TeacherTargetStore`).
        balance: ``"exact"`` (eqs. 9-10 from this step's per-term gradients) or ``"carried"`` (the multipliers of
            the last exact step of the same replay domain, one alignment backward per micro-batch;
            :mod:`claas_verl.align.carried`, docs/math.md §B.6).
        balance_refresh: with ``balance: carried``, every ``balance_refresh``-th replay step of a teacher is exact.
        passes: ``"shared"`` (one student forward per micro-batch gives the token loss and every term; one
            backward per term on it, each term's gradient accumulated on the device) or ``"separate"`` (verl's token
            pass, then one forward + backward per term; one gradient on the device, the others on the host).
            docs/performance.md, "The aligned replay step".
    """

    terms: tuple[str, ...] = ()
    ratio: float = 1.0
    rho: float = 2.0
    window: int = 2000
    layers: tuple[int, ...] | None = None
    drop_trailing: bool = False
    kinds: tuple[str, ...] = ("replay",)
    combine: str = "fsar"
    target_budget_gib: float = 16.0
    balance: str = "exact"
    balance_refresh: int = 4
    passes: str = "shared"

    @property
    def enabled(self) -> bool:
        return bool(self.terms)

    def applies_to(self, kind: str) -> bool:
        return self.enabled and kind in self.kinds

    def to_dict(self) -> dict:
        return {
            "terms": list(self.terms), "ratio": self.ratio, "rho": self.rho, "window": self.window,
            "layers": None if self.layers is None else list(self.layers), "drop_trailing": self.drop_trailing,
            "kinds": list(self.kinds), "combine": self.combine,
            "target_budget_gib": self.target_budget_gib, "balance": self.balance,
            "balance_refresh": self.balance_refresh, "passes": self.passes,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> AuxConfig:
        """Inverse of :meth:`to_dict` (how the config travels to the workers as non-tensor batch data)."""
        signal = {t: t in d["terms"] for t in SIGNAL_TERMS}
        signal.update({k: d[k] for k in ("ratio", "rho", "window", "layers", "drop_trailing", "combine",
                                             "target_budget_gib", "balance", "balance_refresh", "passes")})
        signal["aux_kinds"] = d["kinds"]
        return aux_config(signal)


def aux_config(signal: Mapping | None) -> AuxConfig:
    """Parse ``mopd.signal``; a bad value raises ValueError naming the key."""
    signal = dict(signal or {})
    schema = SignalSection()  # an unset key takes the schema default
    terms = tuple(t for t in SIGNAL_TERMS if signal.get(t))
    if "vr" in terms and "sats" not in terms:
        raise ValueError("mopd.signal.vr=true needs mopd.signal.sats=true "
                         "(docs/math.md §B.5: VR is used only with SATS)")
    ratio, rho = float(signal.get("ratio", schema.ratio)), float(signal.get("rho", schema.rho))
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"mopd.signal.ratio must be a finite number > 0 (eq. 9), got {ratio}")
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"mopd.signal.rho must be a finite number >= 0 (eq. 10), got {rho}")
    window = int(signal.get("window", schema.window))
    if window < 1:
        raise ValueError(f"mopd.signal.window must be >= 1 (docs/math.md §B.3 W), got {window}")
    layers = signal.get("layers", schema.layers)
    if layers in (None, "all"):
        layers = None
    else:
        try:
            layers = tuple(sorted({int(x) for x in layers}))
        except (TypeError, ValueError):
            raise ValueError(f"mopd.signal.layers must be 'all' or a list of 0-based ids, got {layers!r}") from None
        if not layers or layers[0] < 0:
            raise ValueError(f"mopd.signal.layers must be 'all' or non-negative layer ids, got {list(layers)}")
    kinds = tuple(signal.get("aux_kinds", schema.aux_kinds))
    bad = [k for k in kinds if k not in AUX_STEP_KINDS]
    if bad or not kinds:
        raise ValueError(f"mopd.signal.aux_kinds must be a non-empty subset of {list(AUX_STEP_KINDS)} (plan step kinds "
                         f"that run the alignment terms; docs/math.md §B.6/B.8: replay only), got {list(kinds)}")
    combine = str(signal.get("combine", schema.combine))
    if combine not in COMBINE_VARIANTS:
        raise ValueError(f"mopd.signal.combine must be one of {list(COMBINE_VARIANTS)}, got {combine!r}")
    if combine == "1:1:1" and (terms[:1] != ("sats",) or len(terms) != 2):
        raise ValueError("mopd.signal.combine='1:1:1' (MOPD paper Table 4) needs sats=true "
                         "and exactly one of vr / hidden; "
                         f"got terms {list(terms)}")
    budget = float(signal.get("target_budget_gib", schema.target_budget_gib))
    if not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"mopd.signal.target_budget_gib must be a finite number >= 0 (GiB per rank), got {budget}")
    balance_mode = str(signal.get("balance", schema.balance))
    if balance_mode not in BALANCE_MODES:
        raise ValueError(f"mopd.signal.balance must be one of {list(BALANCE_MODES)}, got {balance_mode!r}")
    refresh = signal.get("balance_refresh", schema.balance_refresh)
    if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
        raise ValueError(f"mopd.signal.balance_refresh must be an integer >= 1 (1 = every replay step exact), "
                         f"got {refresh!r}")
    passes = str(signal.get("passes", schema.passes))
    if passes not in PASS_SCHEDULES:
        raise ValueError(f"mopd.signal.passes must be one of {list(PASS_SCHEDULES)} (shared: one forward per "
                         f"micro-batch for every term; separate: a forward per term, less device memory), got "
                         f"{passes!r}")
    return AuxConfig(terms, ratio, rho, window, layers, bool(signal.get("drop_trailing", schema.drop_trailing)), kinds,
                     combine, budget, balance_mode, refresh, passes)


@dataclass(frozen=True)
class SignalSection:
    """The YAML keys of ``mopd.signal`` with their defaults (Replay-KL: no alignment term)."""

    sats: bool = knob(False, "the reasoning-step pooled attention term (SATS, docs/math.md §B.4)")
    vr: bool = knob(False, "the value-relation term (docs/math.md §B.5; needs sats)")
    hidden: bool = knob(False, "the hidden-state term (docs/math.md §B.3)")
    ratio: float = knob(1.0, "r of eq. (9): token : auxiliary gradient norm")
    rho: float = knob(2.0, "ρ of eq. (10), the weight of the hidden-state direction (FSAR only)")
    window: int = knob(2000, "W: the alignment terms see the last W valid response tokens")
    layers: str | list = knob("all", "layers of the alignment terms: all, or a list of 0-based layer ids")
    combine: str = knob("fsar", "fsar: eq. (10) then eq. (9) | 1:1:1: g_tok + ‖g_tok‖ĝ_SATS + ‖g_tok‖ĝ_other (MOPD "
                        "paper Table 4; sats and exactly one of vr / hidden)")
    drop_trailing: bool = knob(False, "docs/math.md §B.4 [CHOICE]: drop a final region that does not end with a "
                               "separator")
    aux_kinds: tuple[str, ...] = knob(("replay",), "plan step kinds that run the alignment terms (docs/math.md "
                                      "§B.6/B.8: replay only; [replay, recovery] is a deviation)")
    target_budget_gib: float = knob(16.0, "host RAM per rank for the teacher's alignment targets of a step; beyond "
                                    "it, streamed")
    balance: str = knob("exact", "exact: eqs. (9)-(10) from this step's per-term gradients (one backward per term) "
                        "| carried: the multipliers of the last exact step of the same replay domain, one alignment "
                        "backward per micro-batch; approximate, see docs/math.md §B.6 and docs/performance.md")
    balance_refresh: int = knob(4, "with balance=carried: every balance_refresh-th replay step of a domain is "
                                "exact and renews the multipliers (1 = every step exact)")
    passes: str = knob("shared", "shared: one student forward per micro-batch gives the token loss and every term, "
                       "one backward per term on it, the terms' gradients accumulated on the device (the floor) | "
                       "separate: verl's token pass, then one forward + backward per term, one gradient on the "
                       "device and the others on the host (less device memory); docs/performance.md")


SIGNAL_KEYS = tuple(SignalSection.__dataclass_fields__)  # every key of mopd.signal
