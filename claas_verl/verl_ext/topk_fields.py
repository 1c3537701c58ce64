"""K values per response token through verl's batches: the two field layouts every top-K loss uses (torch only).

MOPD's token channel (docs/math.md §B.2) and CLaaS SDPO (docs/math.md §A.3.3) both carry, per response token, K
values (the student's top-K ids, log-probs at those ids, per-candidate advantages). TransferQueue and verl's
tensordict utilities treat the LAST dimension of a nested tensor as the ragged one, so a ``[B, T, K]`` tensor does
not survive them. Two layouts are used instead:

* **flattened rows** (every stored field, in TransferQueue or on a training batch): ONE nested field per quantity,
  row ``b`` holding its ``T_b × K`` values row-major (:func:`pack_rows` / :func:`unpack_rows`). verl splits a
  batch into mini- and micro-batches row by row, so each row keeps its values. One field per quantity keeps the
  cost of a batch independent of K: TransferQueue encodes every (row, field) pair separately (measured on 2 CPU
  cores, 64 responses: κ = 32 about 3 s, κ = 261 about 30 s as K separate fields).
* **packed** ``[1, N, K]`` (N packed tokens of a micro-batch): what a logits processor computes. verl's engine
  carries a processor's outputs only as fields of one value per packed token
  (``FSDPEngineWithLMHead.prepare_model_outputs``), so the processor hands them to the loss and the worker past
  verl (:mod:`claas_verl.verl_ext.logits_loss`) instead of as K fields.
"""

from __future__ import annotations

import torch


def pack_row_list(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-row ``[T_b, K]`` tensors -> the flattened-rows nested ``[B, T_b·K]`` field (row b: ``rows[b]`` flat)."""
    widths = {int(r.shape[-1]) for r in rows if r.dim() == 2}
    if any(r.dim() != 2 for r in rows) or len(widths) > 1:
        raise ValueError(f"pack_row_list expects [T_b, K] rows of one K, got shapes {[tuple(r.shape) for r in rows]}")
    return torch.nested.as_nested_tensor([r.reshape(-1) for r in rows], layout=torch.jagged)


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
    return pack_row_list([x[b, : int(n)] for b, n in enumerate(lens.tolist())])


def unpack_rows(x: torch.Tensor, k: int, name: str = "field", setting: str = "k") -> torch.Tensor:
    """Nested ``[B, T_b·K]`` from :func:`pack_rows` -> ``[B, max T_b, K]``, zero padded.

    A row whose length is not a multiple of ``k`` raises naming the field and ``setting`` (the config key of K):
    the field was written with another K."""
    if k < 1:
        raise ValueError(f"k ({setting}) must be >= 1, got {k}")
    if not getattr(x, "is_nested", False):
        raise ValueError(f"{name} must be a nested [B, T_b*K] tensor written by pack_rows, got {type(x).__name__}")
    offsets = x.offsets().long().cpu()
    sizes = offsets.diff()
    if bool((sizes % k).any()):
        raise ValueError(f"{name} has rows of {sizes.tolist()} values, not multiples of {setting}={k}: it "
                         "was written for another K")
    values = x.values()
    lens = (sizes // k).tolist()
    out = values.new_zeros((len(lens), max(lens, default=0), k))
    for b, n in enumerate(lens):
        out[b, :n] = values[int(offsets[b]): int(offsets[b + 1])].view(n, k)
    return out
