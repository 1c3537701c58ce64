"""Alignment terms on MOPD replay steps: shared regions and padded micro-batches (pure torch, no verl); their
config (:class:`AuxConfig`, ``mopd.signal``) is the config layer's :mod:`claas_verl.mopd.config_signal`.

docs/math.md §B.3-B.7. The driver computes the step regions ONCE from the response ids (:func:`response_regions`) and
stores them as two 2-D response-layout fields (:data:`REGION_IDS`, :data:`WINDOW`), because ``[B, T, K]``-shaped
fields do not survive TransferQueue. The teacher (target forward) and the student (balanced update) rebuild the
SAME padded micro-batches from the same rows with :func:`aux_micro_batches`, so both pool over identical query
rows and key axes; the teacher's bf16 targets stay in the colocated worker process and are matched to the
student's batch by :func:`batch_fingerprint`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from claas_verl.align import StepRegions, step_regions
from claas_verl.mopd.config_signal import (  # noqa: F401 (the config layer owns them; re-exported for the trainer)
    AUX_STEP_KINDS,
    COMBINE_VARIANTS,
    SIGNAL_TERMS,
    AuxConfig,
    aux_config,
)

REGION_IDS = "mopd_region_ids"  # [B, T_r] long: region index on window positions, -1 elsewhere
WINDOW = "mopd_window"  # [B, T_r] long: 1 on the window W_b (last W valid response tokens)
AUX_KEY = "mopd_aux"  # non-tensor: the AuxConfig dict of a step that runs the alignment terms
# optional entry of the AUX_KEY dict: the replay step's domain, the key of carried balancing (mopd.signal.balance);
# without it the worker keys the carried multipliers by the step's teacher
DOMAIN_KEY = "domain"
BALANCE_TERM = {"sats": "sats", "vr": "vr", "hidden": "hid"}  # names of claas_verl.align.balanced_backward


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


def response_logits(logits: torch.Tensor, seq_lengths: torch.Tensor, resp_lengths: torch.Tensor,
                    temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of right-padded rows ``[b, T, V]`` -> the response layout ``[b, R, V]`` (R = the longest response).

    Row i holds ``L_i`` tokens, the last ``R_i`` of them its response; response token t is predicted by the logits
    at position ``L_i − R_i − 1 + t`` (verl's shift). Divided by the row's ``temperature`` (``[b]``; verl scales the
    logits the same way before its logits processor); positions beyond ``R_i`` are zero. A copy, with grad.
    """
    b, T, V = logits.shape
    R = int(resp_lengths.max()) if resp_lengths.numel() else 0
    t = torch.arange(R, device=logits.device)
    valid = t[None, :] < resp_lengths[:, None]
    start = seq_lengths - resp_lengths - 1
    if bool(((start < 0) | (seq_lengths > T)).any()):
        raise ValueError(f"response lengths {resp_lengths.tolist()} must be shorter than the sequences "
                         f"{seq_lengths.tolist()}, which must fit the {T} padded positions")
    pos = torch.where(valid, start[:, None] + t[None, :], torch.zeros_like(t)[None, :])
    out = logits.gather(1, pos[..., None].expand(b, R, V))
    if temperature is not None:
        out = out / temperature.to(out.dtype)[:, None, None]
    return out.masked_fill(~valid[..., None], 0.0)


def batch_fingerprint(sequences: list[torch.Tensor]) -> str:
    """Order-sensitive checksum of a batch's token ids (matches the teacher's targets to the student's batch)."""
    crc = 0
    for s in sequences:
        crc = zlib.crc32(s.detach().cpu().long().numpy().tobytes(), crc)
        crc = zlib.crc32(int(s.numel()).to_bytes(8, "little"), crc)
    return f"{len(sequences)}:{crc:08x}"
