"""verl's no-padding batch layout, read the same way by every loss that works on it (MOPD's and CLaaS SDPO's).

With ``use_remove_padding`` verl hands a loss its micro-batch as nested (jagged) tensors: ``input_ids`` is one packed
row of prompt + response tokens per sequence, ``response_mask`` one row per response, and the model's per-token
outputs are packed like ``input_ids``. Logits at packed position ``i`` predict token ``i + 1``. Torch only.

Two layouts appear:

* **packed** (what verl's engine hands a logits processor): all tokens of all sequences of a micro-batch,
  prompt + response, concatenated: ``[N]`` with ``N = Σ_b len(prompt_b) + len(response_b)``. Response token ``t``
  of sequence b is predicted at packed position ``end_b − R_b − 1 + t`` (``end_b`` = exclusive end of b, ``R_b`` =
  its response length): the left shift verl's ``no_padding_2_padding`` / ``response_from_nested`` apply.
* **response** (what the trainers and the losses use): ``[B, T_r, ...]`` padded on the right, or nested per row.
"""

from __future__ import annotations

import torch


def padded(x: torch.Tensor, fill=0) -> torch.Tensor:
    """A nested tensor right-padded with ``fill`` to a dense one; a dense tensor unchanged."""
    return x.to_padded_tensor(fill) if getattr(x, "is_nested", False) else x


def packed_lengths(data, needed_by: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence lengths [B], response lengths [B])`` (on CPU) of a no-padding micro-batch.

    Raises ``ValueError`` naming ``needed_by`` and the fix when the batch is padded (``input_ids`` not nested)."""
    input_ids = data["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise ValueError(f"{needed_by} needs verl's no-padding batch layout (nested input_ids); keep the default "
                         "pad_mode and do not set pad_to_length")
    mask = data["response_mask"]
    resp = mask.offsets().diff() if getattr(mask, "is_nested", False) else mask.new_full((mask.shape[0],),
                                                                                          mask.shape[1])
    return input_ids.offsets().diff().cpu(), resp.cpu()


def response_positions(seq_lens: torch.Tensor, resp_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """Packed positions predicting each response token, and their ``(row, col)`` in the response layout.

    Args:
        seq_lens: ``[B]`` prompt + response length of each sequence (packed, no padding).
        resp_lens: ``[B]`` response length of each sequence.

    Returns:
        ``packed_idx [M]``, ``row [M]``, ``col [M]`` with ``M = Σ resp_lens``: response token ``col`` of sequence
        ``row`` is predicted by the logits at packed position ``packed_idx`` (int64, CPU).
    """
    seq_lens = torch.as_tensor(seq_lens).long().cpu()
    resp_lens = torch.as_tensor(resp_lens).long().cpu()
    if seq_lens.shape != resp_lens.shape or seq_lens.dim() != 1:
        raise ValueError(f"seq_lens and resp_lens must be equal-length 1-D; got {seq_lens.shape}, {resp_lens.shape}")
    if bool((resp_lens >= seq_lens).any()):
        raise ValueError("every sequence needs a non-empty prompt (response length < sequence length)")
    ends = seq_lens.cumsum(0)
    rows, cols, idx = [], [], []
    for b in range(seq_lens.shape[0]):
        r = int(resp_lens[b])
        start = int(ends[b]) - r - 1
        rows.append(torch.full((r,), b, dtype=torch.long))
        cols.append(torch.arange(r, dtype=torch.long))
        idx.append(torch.arange(start, start + r, dtype=torch.long))

    def cat(xs):
        return torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)

    return cat(idx), cat(rows), cat(cols)


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
