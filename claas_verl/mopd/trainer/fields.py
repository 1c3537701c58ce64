"""Per-token fields the MOPD trainer stores in verl's TransferQueue and on its batches, by name.

The token channel (docs/math.md §B.2.1) carries K = κ values per response token. The layouts are shared with
CLaaS SDPO and described in :mod:`claas_verl.verl_ext.topk_fields` (flattened rows: one field per quantity;
K packed fields: a logits processor's outputs) and :mod:`claas_verl.verl_ext.packed_batch` (packed and response
positions). The worker folds the K packed fields of a forward into one flattened-rows field (:data:`FOLDED`) before
its output reaches TransferQueue: at κ = 128 the K-field round trip through the trainer cost about 2 s per forward
of an 11.5 s CPU benchmark step.

The layout helpers are re-exported here (``F.pack_rows`` etc.); :func:`names` and :func:`unpack_rows` name
``mopd.train.topk`` in their errors.
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
from claas_verl.verl_ext.topk_fields import pack_row_list, pack_rows, split_last  # noqa: F401  (re-exported)

TOPK_SETTING = "mopd.train.topk"

# Logits-processor outputs: one field per candidate j, f"{prefix}{j}", packed layout.
STUDENT_IDS_PACKED = "mopd_sid_packed_"  # student top-k ids, packed layout (pre-update forward output)
STUDENT_LP_PACKED = "mopd_slp_packed_"  # student top-k log-probs S, packed layout
TEACHER_LP_PACKED = "mopd_tlp_packed_"  # teacher log-probs Q at the student's ids, packed layout
CURRENT_LP_PACKED = "mopd_clp_packed_"  # differentiable log π_θ at the stored ids, packed (update forward)
# TransferQueue fields: one flattened-rows field each (pack_rows), response layout.
TOPK_IDS = "mopd_ids"  # student top-k ids
STUDENT_LP = "mopd_slp"  # student top-k log-probs S (θ_old)
TEACHER_LP = "mopd_tlp"  # teacher log-probs Q at the student's ids (worker-written, from TEACHER_LP_PACKED)
ADVANTAGES = "mopd_adv"  # per-candidate advantages A
# The worker's output: K packed logits-processor fields -> the one flattened-rows field TransferQueue carries.
FOLDED = {STUDENT_IDS_PACKED: TOPK_IDS, STUDENT_LP_PACKED: STUDENT_LP, TEACHER_LP_PACKED: TEACHER_LP}

# Non-tensor keys the trainer puts on a batch to tell the loss function what a forward is for.
PHASE_KEY = "mopd_phase"
PHASE_STUDENT_TOPK = "student_topk"
PHASE_TEACHER = "teacher"
PHASE_UPDATE = "update"
PHASES = (PHASE_STUDENT_TOPK, PHASE_TEACHER, PHASE_UPDATE)
TOPK_KEY = "mopd_topk"


def names(prefix: str, k: int) -> list[str]:
    """The K field names ``[prefix0, ..., prefix{k-1}]`` (:func:`claas_verl.verl_ext.topk_fields.names`)."""
    return _tf.names(prefix, k, TOPK_SETTING)


def unpack_rows(x: torch.Tensor, k: int, name: str = "field") -> torch.Tensor:
    """Nested ``[B, T_b·K]`` -> ``[B, max T_b, K]`` (:func:`claas_verl.verl_ext.topk_fields.unpack_rows`)."""
    return _tf.unpack_rows(x, k, name, TOPK_SETTING)
