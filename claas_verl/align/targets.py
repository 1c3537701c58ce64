"""Shared small types of the alignment terms: teacher-target rounding and per-micro-batch values."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_bf16_target(x: torch.Tensor) -> torch.Tensor:
    """Teacher alignment target: detached and rounded to bf16 (docs/math.md §B.1 precision, B.3, B.4).

    Idempotent, so losses apply it again to whatever teacher tensor they receive; the loss then
    casts the target back to fp32 before any math.
    """
    return x.detach().to(torch.bfloat16)


@dataclass
class TermValue:
    """One alignment term on one micro-batch (docs/math.md §B.7).

    Attributes:
        loss: scalar fp32 ``ℓ_term(mb)`` (a mean over window positions for ℓ_hid, over responses with
            at least one region for SATS/VR); exactly 0 with zero gradient when the count is 0.
        count: the denominator used: ``N_W`` window positions (ℓ_hid) or ``|Y|`` responses with ≥1
            region (SATS/VR).
        n_responses: ``n_resp(mb)``, all responses of the micro-batch. B.7 weights micro-batches by
            ``n_resp(mb)/n_resp_total``: ``L_term = Σ_mb (n_resp(mb)/n_resp_total)·ℓ_term(mb)``.
    """

    loss: torch.Tensor
    count: int
    n_responses: int
