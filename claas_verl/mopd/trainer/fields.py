"""Per-token fields the MOPD trainer stores in verl's TransferQueue and on its batches, by name.

The token channel (docs/math.md §B.2.1) carries K = κ values per response token. The layouts are shared with
CLaaS SDPO and described in :mod:`claas_verl.verl_ext.topk_fields` (flattened rows: one field per quantity) and
:mod:`claas_verl.verl_ext.packed_batch` (packed and response positions). The loss's logits processor hands its
packed ``[1, N, κ]`` outputs past verl's per-field output handling (:mod:`claas_verl.verl_ext.logits_loss`), under
the names below; the worker writes each forward-only output as the one flattened-rows field of the same name
(:func:`claas_verl.mopd.trainer.workers.fold_topk_outputs`) before it reaches TransferQueue.

The layout helpers are re-exported here (``fields.pack_rows`` etc.); :func:`unpack_rows` names ``mopd.train.topk`` in
its errors.
"""

from __future__ import annotations

import torch

from claas_verl.verl_ext import topk_fields as _tf
from claas_verl.verl_ext.packed_batch import (  # noqa: F401  (re-exported)
    gather_packed_to_response,
    response_ids,
    response_positions,
    scatter_response_to_packed,
)
from claas_verl.verl_ext.topk_fields import pack_row_list, pack_rows  # noqa: F401  (re-exported)

TOPK_SETTING = "mopd.train.topk"

# TransferQueue fields: one flattened-rows field each (pack_rows), response layout; the forward-only processor
# outputs (packed [1, N, K]) carry the same names.
TOPK_IDS = "mopd_ids"  # student top-k ids (student_topk forward)
STUDENT_LP = "mopd_slp"  # student top-k log-probs S (θ_old) (student_topk forward)
TEACHER_LP = "mopd_tlp"  # teacher log-probs Q at the student's ids (teacher forward)
ADVANTAGES = "mopd_adv"  # per-candidate advantages A
# The update's processor output (packed [1, N, K], with grad), handed to the loss of the same micro-batch only.
CURRENT_LP = "mopd_clp"
# What a forward-only pass writes back: the processor outputs folded into flattened rows.
FOLDED = (TOPK_IDS, STUDENT_LP, TEACHER_LP)

# Non-tensor keys the trainer puts on a batch to tell the loss function what a forward is for.
PHASE_KEY = "mopd_phase"
PHASE_STUDENT_TOPK = "student_topk"
PHASE_TEACHER = "teacher"
PHASE_UPDATE = "update"
PHASES = (PHASE_STUDENT_TOPK, PHASE_TEACHER, PHASE_UPDATE)
TOPK_KEY = "mopd_topk"


def unpack_rows(x: torch.Tensor, k: int, name: str = "field") -> torch.Tensor:
    """Nested ``[B, T_b·K]`` -> ``[B, max T_b, K]`` (:func:`claas_verl.verl_ext.topk_fields.unpack_rows`)."""
    return _tf.unpack_rows(x, k, name, TOPK_SETTING)
