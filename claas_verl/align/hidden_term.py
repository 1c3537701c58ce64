"""OPRD hidden-state alignment term (docs/math.md §B.3, MOPD paper eq. 6).

    ĥ = h / max(‖h‖₂, 1e-12)                                   (F.normalize, per token and layer)
    ℓ_hid(mb) = (1/|L_h|) Σ_l (1/N_W) Σ_b Σ_{t∈W_b} (1/D)·‖ĥ_S^l[b,t] − ĥ_T^l[b,t]‖²,   N_W = Σ_b |W_b|

Since both vectors are unit, ‖ĥ_S − ĥ_T‖² = 2(1 − cos), i.e. the LastOPD "2(1−cos)/D" form.
Teacher states are rounded to bf16, then cast to fp32 before normalising (docs/math.md §E.10 [CHOICE]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from claas_verl.align.targets import TermValue, to_bf16_target
from claas_verl.utils.masked import agg_loss


def window_states(hidden: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """Select the window positions: ``[B, T, D]`` -> ``[N_W, D]`` (row-major order of ``window_mask``)."""
    if hidden.dim() == 2:
        return hidden  # already gathered
    if hidden.shape[:2] != window_mask.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match window_mask {tuple(window_mask.shape)}")
    return hidden[window_mask.bool()]


def hidden_alignment_loss(
    student_hidden: Sequence[torch.Tensor],
    teacher_hidden: Sequence[torch.Tensor],
    window_mask: torch.Tensor,
) -> TermValue:
    """ℓ_hid of one micro-batch (docs/math.md §B.3).

    Args:
        student_hidden: one tensor per layer in ``L_h``, ``[B, T, D]`` (HF ``hidden_states[l+1]``) or
            already window-gathered ``[N_W, D]``; differentiable.
        teacher_hidden: same layers and shapes; detached and rounded to bf16 here (idempotent).
        window_mask: ``[B, T]`` bool, the windows ``W_b`` (``StepRegions.window_mask`` in sequence coordinates).

    Returns:
        :class:`TermValue` with ``count = N_W``; loss 0 (zero gradient) when the windows are empty.
    """
    if len(student_hidden) != len(teacher_hidden) or not student_hidden:
        raise ValueError(
            f"student_hidden has {len(student_hidden)} layers, teacher_hidden {len(teacher_hidden)}; "
            "need the same non-empty layer list L_h"
        )
    n_w = int(window_mask.bool().sum())
    per_pos = None
    for s, t in zip(student_hidden, teacher_hidden):
        s_w = window_states(s, window_mask).float()
        t_w = to_bf16_target(window_states(t, window_mask)).float()
        if s_w.shape != t_w.shape or s_w.shape[0] != n_w:
            raise ValueError(f"window states {tuple(s_w.shape)} vs {tuple(t_w.shape)}; expected [N_W={n_w}, D]")
        d = (F.normalize(s_w, p=2, dim=-1) - F.normalize(t_w, p=2, dim=-1)).pow(2).mean(-1)  # (1/D)‖·‖²
        per_pos = d if per_pos is None else per_pos + d
    per_pos = per_pos / len(student_hidden)
    loss = agg_loss(per_pos[None, :], torch.ones_like(per_pos[None, :], dtype=torch.bool), "token-mean")
    return TermValue(loss=loss, count=n_w, n_responses=int(window_mask.shape[0]))
