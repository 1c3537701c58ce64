"""verl's no-padding batch layout, read the same way by every loss that works on it (MOPD's and CLaaS SDPO's).

With ``use_remove_padding`` verl hands a loss its micro-batch as nested (jagged) tensors: ``input_ids`` is one packed
row of prompt + response tokens per sequence, ``response_mask`` one row per response, and the model's per-token
outputs are packed like ``input_ids``. Logits at packed position ``i`` predict token ``i + 1``. Torch only.
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
