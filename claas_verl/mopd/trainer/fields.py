"""Per-token fields the MOPD trainer stores in verl's TransferQueue, and the packing helpers (pure torch).

TransferQueue and verl's tensordict utilities treat the LAST dimension of a nested tensor as the ragged one,
so a ``[B, T, K]`` tensor of top-k values does not survive the trip. Two ways around it:

* **flattened rows** (every field that enters TransferQueue: ids, S, Q, advantages): ONE field per quantity,
  row ``b`` holding its ``T_b × K`` values row-major (:func:`pack_rows` / :func:`unpack_rows`). TransferQueue
  encodes every (row, field) pair separately, so K fields per quantity made a step cost grow with κ (measured
  on 2 CPU cores, 64 responses: κ = 32 about 3 s, κ = 261 about 30 s); one field per quantity does not.
* **K fields** ``<prefix><j>`` of shape ``[N]`` (j = 0..K-1): what a logits processor returns, since verl's
  engine requires every processor output to have exactly one value per packed token
  (``FSDPEngineWithLMHead.prepare_model_outputs``). The worker folds them into one flattened-rows field
  (:data:`FOLDED`) before its output reaches TransferQueue: at κ = 128 the K-field round trip through the
  trainer cost about 2 s per forward of an 11.5 s CPU benchmark step.

Two layouts appear:

* **packed** (what verl's engine hands a logits processor): all tokens of all sequences of a micro-batch,
  prompt + response, concatenated: ``[N]`` with ``N = Σ_b len(prompt_b) + len(response_b)``. The logits at
  packed position ``i`` predict token ``i+1``, so response token ``t`` of sequence b is predicted at packed
  position ``end_b − R_b − 1 + t`` (``end_b`` = exclusive end of b, ``R_b`` = its response length). This is
  the same left shift verl's ``no_padding_2_padding`` / ``response_from_nested`` apply.
* **response** (what the trainer and the loss use): ``[B, T_r]`` padded on the right, or nested per row.
"""

from __future__ import annotations

import torch

from claas_verl.verl_ext.packed_batch import response_positions  # noqa: F401  (re-exported for the loss)

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
    """The K field names ``[prefix0, ..., prefix{k-1}]``."""
    if k < 1:
        raise ValueError(f"k (mopd.train.topk) must be >= 1, got {k}")
    return [f"{prefix}{j}" for j in range(k)]


def split_last(x: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """``[..., K]`` -> ``{prefix_j: x[..., j]}`` (contiguous copies, safe to send through TransferQueue)."""
    return {f"{prefix}{j}": x[..., j].contiguous() for j in range(x.shape[-1])}


def pack_rows(x: torch.Tensor, lengths) -> torch.Tensor:
    """Response-layout ``[B, T, K]`` (right padded) -> nested ``[B, T_b·K]``: row b is ``x[b, :T_b]`` flattened.

    ``lengths`` is ``[B]`` (T_b per row) or a nested ``[B, T_b]`` tensor whose row lengths are used (e.g. the
    response mask)."""
    if x.dim() != 3:
        raise ValueError(f"pack_rows expects [B, T, K], got {tuple(x.shape)}")
    lens = lengths.offsets().diff() if getattr(lengths, "is_nested", False) else torch.as_tensor(lengths)
    lens = lens.long().cpu()
    if lens.shape != (x.shape[0],) or bool((lens < 0).any()) or bool((lens > x.shape[1]).any()):
        raise ValueError(f"pack_rows: row lengths {lens.tolist()} do not fit a "
                         f"[B={x.shape[0]}, T={x.shape[1]}, K] tensor")
    rows = [x[b, : int(n)].reshape(-1) for b, n in enumerate(lens.tolist())]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def unpack_rows(x: torch.Tensor, k: int, name: str = "field") -> torch.Tensor:
    """Nested ``[B, T_b·K]`` from :func:`pack_rows` -> ``[B, max T_b, K]``, zero padded.

    A row whose length is not a multiple of ``k`` raises naming the field: it was written with another κ."""
    if k < 1:
        raise ValueError(f"k (mopd.train.topk) must be >= 1, got {k}")
    if not getattr(x, "is_nested", False):
        raise ValueError(f"{name} must be a nested [B, T_b*K] tensor written by pack_rows, got {type(x).__name__}")
    offsets = x.offsets().long().cpu()
    sizes = offsets.diff()
    if bool((sizes % k).any()):
        raise ValueError(f"{name} has rows of {sizes.tolist()} values, not multiples of mopd.train.topk={k}: it "
                         "was written for another kappa")
    values = x.values()
    lens = (sizes // k).tolist()
    out = values.new_zeros((len(lens), max(lens, default=0), k))
    for b, n in enumerate(lens):
        out[b, :n] = values[int(offsets[b]): int(offsets[b + 1])].view(n, k)
    return out


def response_ids(input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The response token ids themselves, ``[B, R_b]`` nested: the last ``R_b`` tokens of each packed row.

    Not :func:`verl.workers.utils.padding.response_from_nested`, which shifts left by one (right for the log-probs
    a model OUTPUTS at the positions predicting the response, wrong for the ids): on ids it would give
    ``[last prompt token, y_0 .. y_{R-2}]``.

    Args:
        input_ids: nested (jagged) ``[B, L_b]`` prompt + response ids (verl's no-padding layout).
        response_mask: nested ``[B, R_b]`` (only its lengths are used).
    """
    if not (getattr(input_ids, "is_nested", False) and getattr(response_mask, "is_nested", False)):
        raise ValueError("response_ids needs verl's no-padding layout: nested input_ids and response_mask")
    values, ends = input_ids.values(), input_ids.offsets()[1:]
    lens = response_mask.offsets().diff()
    if lens.shape != ends.shape:
        raise ValueError(f"{ends.numel()} input_ids rows but {lens.numel()} response_mask rows")
    starts = input_ids.offsets()[:-1]
    rows = []
    for b, (r, e) in enumerate(zip(lens.tolist(), ends.tolist())):
        if not 0 < r < e - int(starts[b]):
            raise ValueError(f"row {b}: response length {r} must be in (0, sequence length {e - int(starts[b])})")
        rows.append(values[e - r:e])
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def scatter_response_to_packed(values: torch.Tensor, seq_lens, resp_lens, total: int, fill=0) -> torch.Tensor:
    """Response-layout ``[B, T_r, ...]`` (right padded) -> packed ``[total, ...]`` (``fill`` off the response)."""
    idx, rows, cols = response_positions(seq_lens, resp_lens)
    out = torch.full((total, *values.shape[2:]), fill, dtype=values.dtype, device=values.device)
    out[idx.to(values.device)] = values[rows.to(values.device), cols.to(values.device)]
    return out


def gather_packed_to_response(packed: torch.Tensor, seq_lens, resp_lens, width: int | None = None) -> torch.Tensor:
    """Packed ``[total, ...]`` -> response layout ``[B, T_r, ...]``, zero padded (differentiable)."""
    idx, rows, cols = response_positions(seq_lens, resp_lens)
    B = int(torch.as_tensor(seq_lens).shape[0])
    T = int(torch.as_tensor(resp_lens).max()) if width is None and B else (width or 0)
    dev = packed.device
    out = packed.new_zeros((B, T, *packed.shape[1:]))
    return out.index_put((rows.to(dev), cols.to(dev)), packed[idx.to(dev)])
