"""Alignment terms on MOPD replay steps: config, shared regions and padded micro-batches (pure torch, no verl).

docs/math.md §B.3-B.7. The driver computes the step regions ONCE from the response ids (:func:`response_regions`) and
stores them as two 2-D response-layout fields (:data:`REGION_IDS`, :data:`WINDOW`), because ``[B, T, K]``-shaped
fields do not survive TransferQueue. The teacher (target forward) and the student (balanced update) rebuild the
SAME padded micro-batches from the same rows with :func:`aux_micro_batches`, so both pool over identical query
rows and key axes; the teacher's bf16 targets stay in the colocated worker process and are matched to the
student's batch by :func:`batch_fingerprint`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from claas_verl.align import StepRegions, step_regions

REGION_IDS = "mopd_region_ids"  # [B, T_r] long: region index on window positions, -1 elsewhere
WINDOW = "mopd_window"  # [B, T_r] long: 1 on the window W_b (last W valid response tokens)
AUX_KEY = "mopd_aux"  # non-tensor: the AuxConfig dict of a step that runs the alignment terms
SIGNAL_TERMS = ("sats", "vr", "hidden")  # names of claas_verl.align.alignment_signals
COMBINE_VARIANTS = ("fsar", "1:1:1")  # mopd.signal.combine: eq. (10)+(9), or MOPD paper Table 4's 1:1:1
AUX_STEP_KINDS = ("replay", "recovery")  # new-domain and joint steps never run the alignment terms (docs/math.md §B.6)
BALANCE_TERM = {"sats": "sats", "vr": "vr", "hidden": "hid"}  # names of claas_verl.align.balanced_backward


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
            "target_budget_gib": self.target_budget_gib,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> AuxConfig:
        """Inverse of :meth:`to_dict` (how the config travels to the workers as non-tensor batch data)."""
        signal = {t: t in d["terms"] for t in SIGNAL_TERMS}
        signal.update({k: d[k] for k in ("ratio", "rho", "window", "layers", "drop_trailing", "combine",
                                             "target_budget_gib")})
        signal["aux_kinds"] = d["kinds"]
        return aux_config(signal)


def aux_config(signal: Mapping | None) -> AuxConfig:
    """Parse ``mopd.signal``; a bad value raises ValueError naming the key."""
    signal = dict(signal or {})
    schema = AuxConfig()  # an unset key takes the dataclass default: recipes/mopd/signal/kl.yaml repeats them
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
    kinds = tuple(signal.get("aux_kinds", schema.kinds))
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
    return AuxConfig(terms, ratio, rho, window, layers, bool(signal.get("drop_trailing", schema.drop_trailing)), kinds,
                     combine, budget)


def check_layers(cfg: AuxConfig, num_layers: int) -> list[int]:
    """The layer ids of the terms for a model with ``num_layers`` decoder layers (ValueError when out of range)."""
    if cfg.layers is None:
        return list(range(num_layers))
    bad = [x for x in cfg.layers if x >= num_layers]
    if bad:
        raise ValueError(f"mopd.signal.layers {list(cfg.layers)}: {bad} out of range for a {num_layers}-layer model")
    return list(cfg.layers)


def response_regions(responses: torch.Tensor, response_mask: torch.Tensor, separator_ids, cfg: AuxConfig):
    """Driver side: ``(region_ids [B, T_r] long, window [B, T_r] long)`` of the step (docs/math.md §B.3 window, B.4
    regions)."""
    reg = step_regions(responses, response_mask, separator_ids, window=cfg.window, drop_trailing=cfg.drop_trailing)
    return reg.region_ids.long(), reg.window_mask.long()


def region_fields(input_ids: torch.Tensor, response_mask: torch.Tensor, separator_ids, cfg: AuxConfig):
    """The driver's step-region fields from verl's nested batch fields (what ``MOPDTrainer`` stores).

    Args:
        input_ids: nested ``[B, L_b]`` prompt + response ids; response_mask: nested ``[B, R_b]``.

    Returns:
        ``({REGION_IDS: nested [B, R_b], WINDOW: nested [B, R_b]}, region_ids [B, T_r], window [B, T_r])``,
        built from the response ids themselves (:func:`claas_verl.mopd.trainer.fields.response_ids`).
    """
    from claas_verl.mopd.trainer.fields import response_ids

    ids = response_ids(input_ids, response_mask).to_padded_tensor(0)
    mask = response_mask.to_padded_tensor(0)
    rid, win = response_regions(ids, mask, separator_ids, cfg)
    lens = response_mask.offsets().diff().tolist()

    def nest(x):
        return torch.nested.as_nested_tensor([x[b, :n] for b, n in enumerate(lens)], layout=torch.jagged)

    return {REGION_IDS: nest(rid), WINDOW: nest(win)}, rid, win


@dataclass
class AuxMicroBatch:
    """One right-padded micro-batch of full sequences (prompt + response) with regions in sequence coordinates."""

    input_ids: torch.Tensor  # [b, T] long
    attention_mask: torch.Tensor  # [b, T] long
    position_ids: torch.Tensor  # [b, T] long
    regions: StepRegions  # [b, T] region ids / window mask, num_regions [b]
    n_resp: int

    def to(self, device) -> AuxMicroBatch:
        return AuxMicroBatch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                             self.regions.to(device), self.n_resp)


def aux_micro_batches(
    sequences: list[torch.Tensor],
    region_ids: torch.Tensor,
    window: torch.Tensor,
    response_lengths: torch.Tensor,
    groups: list[list[int]],
    pad_id: int = 0,
) -> list[AuxMicroBatch]:
    """One padded micro-batch per row group: the SAME micro-batches as the token pass (docs/math.md §B.6/B.7).

    Args:
        sequences: per row, the unpadded prompt + response ids ``[L_b]`` (response = last ``R_b`` tokens).
        region_ids, window: ``[B, T_r]`` response layout (right padded; -1 / 0 beyond ``R_b``).
        response_lengths: ``[B]`` ``R_b``.
        groups: the row indices of each micro-batch, as verl's engine partitions the update batch
            (:func:`claas_verl.mopd.trainer.workers.update_row_groups`); every row exactly once.

    Returns:
        Micro-batches in group order; positions are ``0..L_b-1`` (right padding, masked).
    """
    B = len(sequences)
    if region_ids.shape != window.shape or region_ids.shape[0] != B or response_lengths.shape[0] != B:
        raise ValueError(
            f"{REGION_IDS} {tuple(region_ids.shape)}, {WINDOW} {tuple(window.shape)} and {B} sequences / "
            f"{tuple(response_lengths.shape)} response lengths disagree: region fields of another batch"
        )
    flat = sorted(b for g in groups for b in g)
    if flat != list(range(B)):
        raise ValueError(f"micro-batch row groups {groups} must cover the {B} rows exactly once")
    out = []
    for rows in groups:
        if not rows:
            continue
        T = max(int(sequences[b].numel()) for b in rows)
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
        am = torch.zeros((len(rows), T), dtype=torch.long)
        rid = torch.full((len(rows), T), -1, dtype=torch.long)
        win = torch.zeros((len(rows), T), dtype=torch.bool)
        for i, b in enumerate(rows):
            L, R = int(sequences[b].numel()), int(response_lengths[b])
            if not 0 < R < L:
                raise ValueError(f"row {b}: response length {R} must be in (0, sequence length {L})")
            ids[i, :L] = sequences[b].long().cpu()
            am[i, :L] = 1
            rid[i, L - R:L] = region_ids[b, :R].long().cpu()
            win[i, L - R:L] = window[b, :R].bool().cpu()
        num = (rid.amax(-1) + 1).clamp(min=0)
        pos = torch.arange(T, dtype=torch.long).expand(len(rows), T).clone()
        out.append(AuxMicroBatch(ids, am, pos, StepRegions(rid, win, num), len(rows)))
    return out


def batch_fingerprint(sequences: list[torch.Tensor]) -> str:
    """Order-sensitive checksum of a batch's token ids (matches the teacher's targets to the student's batch)."""
    crc = 0
    for s in sequences:
        crc = zlib.crc32(s.detach().cpu().long().numpy().tobytes(), crc)
        crc = zlib.crc32(int(s.numel()).to_bytes(8, "little"), crc)
    return f"{len(sequences)}:{crc:08x}"
